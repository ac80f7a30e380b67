"""cflib: efficient full-parameter SFT of TR-MoE language models, Jupyter first.

The package in layers; each imports only from the layers below it
(tests/test_architecture.py keeps it so):

    lab     what a person sees in JupyterLab: forms, run reports, `python -m cflib.lab`
    bench   throughput beside the peer stack, the micro-batch tuner, kernel validation
    train   parameters, prepare, the execution plan, the step and the loop, data parallelism, evaluation, records
    export  the trained model leaving the project: the Hugging Face Hub bundle
    model   the TR-MoE decoder, its route tables and checkpoints  |  data   shards, conversion, packing, weighting
    ops     Triton and Liger kernels, attention backends, their references and dispatch
    errors, atomic, paths, yamlio, jsonio, locks, lazy: the foundation every layer may use; jobs (the job
    skeleton) and schema (the parameter schema) build on them
"""
__version__ = "0.1.0"
