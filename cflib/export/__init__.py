"""export: the trained model leaving the project.

Owns the Hugging Face Hub bundle (`python -m cflib.export hub CHECKPOINT OUT`)
and the modules it carries. Imports model, data and the foundation modules;
never train, bench or lab.
"""
