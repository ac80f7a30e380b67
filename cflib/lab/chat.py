"""Answers from a checkpoint: every prompt of a list (papermill), and a chat box in JupyterLab.

Prompts are rendered by the chat converter's own template code (its
renderer's render_prompt: the role markers, or with `template: tokenizer` the
tokenizer folder's Jinja chat template through apply_chat_template and its
generation prompt), so the model sees a conversation exactly as it saw its
training data; answers come from cflib.model.generate's KV-cache decoder. Everything is checked before anything is generated: the
parameters, the checkpoint, a tokenizer whose vocabulary the model covers, a
template that names the assistant's marker, and every prompt's length.
"""
from __future__ import annotations

import itertools
import json
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch

from cflib.atomic import atomic_file, write_json_atomic
from cflib.data import (
    TOKENIZER_TEMPLATE,
    ChatTemplate,
    ConvertError,
    Renderer,
    conversation_to_answer,
    make_renderer,
)
from cflib.data.convert import read_template
from cflib.data.rendering import tokenizer_record
from cflib.data.shards import sha256_file
from cflib.errors import ParamError
from cflib.export.peft import (
    ADAPTER_WEIGHTS_FILE,
    base_matches_training,
    holds_weights,
    is_adapter_checkpoint,
    load_merged,
)
from cflib.jobs import job_out_dir, record_header, refuse_links
from cflib.jsonio import json_lines
from cflib.model import CheckpointError, load_checkpoint
from cflib.model.checkpoint import WEIGHTS_FILE, checkpoint_in
from cflib.model.generate import Decoder, GenerationError, Sampling
from cflib.paths import resolve_path
from cflib.progress import tqdm
from cflib.schema import Params, as_given, parsed_by
from cflib.train import TrainParams, fit, prepare
from cflib.train.records import count_parameters
from cflib.train.run import resolve_device



@dataclass(frozen=True)
class ChatParams(Params):
    """chat.ipynb's parameters. Defaults: a quickstart-size model trained here for a few steps, on the CPU."""

    # a checkpoint folder (LoRA adapters merged into their base), a run folder (its best, else last...); None: train one
    checkpoint: str | None = None
    tokenizer: str = "byte"  # "byte", or the tokenizer.json or tokenizer folder the data was converted with
    # cflib.data.ChatTemplate keys; None: the default (byte tokenizer's specials); "tokenizer": the folder's own
    template: dict | str | None = parsed_by(read_template, None)
    # a JSONL path of {"messages": [...]}, or a list of those or of plain user texts
    prompts: list | tuple | str = parsed_by(as_given, ())
    max_new_tokens: int = 32
    temperature: float = 0.0  # 0: greedy
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = 0  # sampling's seed: the same answers again
    bf16: bool = False
    device: str = "auto"
    out_dir: str | None = None  # None: a new outputs/chat/<time>/
    train_steps: int = 32  # with checkpoint None: optimizer steps of the model trained here

    def validate(self) -> None:
        if not isinstance(self.prompts, (str, list, tuple)) or not self.prompts:
            raise ParamError(f"prompts: a JSONL path or a non-empty list, got {self.prompts!r}")
        if self.max_new_tokens < 1 or self.train_steps < 1:
            raise ParamError("max_new_tokens and train_steps must be positive integers")
        if self.device not in ("auto", "cpu", "cuda"):
            raise ParamError(f"device must be auto, cpu or cuda, got {self.device!r}")
        try:  # before `checkpoint: None` trains a model for minutes
            Sampling(self.temperature, self.top_p, self.top_k)
        except GenerationError as err:
            raise ParamError(str(err)) from None

    def generation(self) -> dict[str, Any]:
        return {"max_new_tokens": self.max_new_tokens, "temperature": self.temperature, "top_p": self.top_p,
                "top_k": self.top_k, "seed": self.seed}


def find_checkpoint(path: str | Path) -> Path:
    """A checkpoint folder (a model's, or LoRA adapters'), or the one a run folder stands for: its best, else its
    last, else its newest epoch-N or step-N (cflib.model.checkpoint.run_checkpoint)."""
    folder = resolve_path(path)
    found = checkpoint_in(folder, holds_weights)
    if found is not None:
        return found
    raise CheckpointError(f"checkpoint {folder}: neither a checkpoint folder (config.json + {WEIGHTS_FILE}, or LoRA "
                          "adapters) nor a run folder with a checkpoint (best, last, epoch-N or step-N)")


def train_here(out_dir: Path, steps: int, device: str, seed: int = 0) -> tuple[Path, dict]:
    """A quickstart-size model trained for `steps` optimizer steps on the embedded tasks, under out_dir:
    enough to learn the answers' form, not their content (params/quickstart.yaml trains ~1,000 steps)."""
    params = TrainParams.from_dict({
        "model": "quickstart", "data": "embedded", "out_dir": str(out_dir), "seed": seed, "seq_len": 64,
        "micro_batch_per_rank": 64, "global_batch": 64, "epochs": 1, "max_steps": steps, "lr": 3e-3,
        "warmup_ratio": 0.05, "eval_at_start": False, "exact_match_limit": 0, "device": device})
    record = fit(prepare(params))
    return Path(record["checkpoints"]["best"]), record


def read_conversations(prompts: list | tuple | str) -> list[list[dict]]:
    """Each conversation's messages, from a JSONL path or a list (a plain string is one user turn)."""
    if isinstance(prompts, str):
        path = resolve_path(prompts)
        if not path.is_file():
            raise ParamError(f"prompts: {path} is not a file (a JSONL of {{\"messages\": [...]}} rows, or a list)")
        rows = [(row, f"{path}:{number}") for number, row in json_lines(path, ConvertError)]
    else:
        rows = [({"messages": [{"role": "user", "content": item}]} if isinstance(item, str) else item,
                 f"prompts[{index}]") for index, item in enumerate(prompts)]
    if not rows:
        raise ParamError("prompts: no conversation to answer")
    return [conversation_to_answer(row, where) for row, where in rows]


def chat_renderer(tokenizer: str, template: dict | str | None) -> Renderer:
    """The converter's renderer for this tokenizer and template: a template the model could not read (no
    assistant marker among them) is refused as the converter refuses it."""
    try:
        markers = template if template == TOKENIZER_TEMPLATE else ChatTemplate.from_dict(template or {}, "template")
        return make_renderer(tokenizer, markers, "final_turn")
    except ConvertError as err:
        raise ParamError(str(err)) from None


class ChatSession:
    """A checkpoint, its tokenizer and template, and a decoder that keeps its caches between turns."""

    def __init__(self, checkpoint: str | Path, tokenizer: str = "byte", template: dict | str | None = None,
                 device: str = "auto", bf16: bool = False) -> None:
        self.renderer = chat_renderer(tokenizer, template)
        self.tokenizer = self.renderer.tokenizer
        self.checkpoint = find_checkpoint(checkpoint)
        self.device = resolve_device(device)
        self.adapters = is_adapter_checkpoint(self.checkpoint)  # merged into their recorded base, in memory
        self.model = (load_merged(self.checkpoint).to(self.device) if self.adapters
                      else load_checkpoint(self.checkpoint, self.device))
        self.base_matches_training = base_matches_training(self.checkpoint) if self.adapters else None
        if self.base_matches_training is False:
            warnings.warn(f"{self.checkpoint}: the base these adapters are merged into has changed since they were "
                          "trained (its weights' SHA-256 differs): the answers are that base's plus the adapters",
                          stacklevel=2)
        vocab = self.model.config.vocab_size
        if self.tokenizer.vocab_size > vocab:
            raise ParamError(f"tokenizer {self.tokenizer.description} has {self.tokenizer.vocab_size:,} tokens, "
                             f"more than the model's vocab_size {vocab:,} ({self.checkpoint}): it is not the "
                             "tokenizer this model was trained with")
        self.decoder = Decoder(self.model, autocast_dtype=torch.bfloat16 if bf16 else None)

    def prompt_ids(self, conversations: list[list[dict]], max_new_tokens: int) -> list[list[int]]:
        """Each conversation rendered, every one checked against the model's positions."""
        prompts = [self.renderer.render_prompt(messages) for messages in conversations]
        limit = self.model.config.max_position_embeddings
        for index, prompt in enumerate(prompts):
            if len(prompt) + max_new_tokens > limit:
                raise GenerationError(f"prompt {index}: {len(prompt)} tokens + max_new_tokens {max_new_tokens} "
                                      f"exceeds the model's max_position_embeddings {limit}")
        return prompts

    def answer_text(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids[:-1] if ids and ids[-1] == self.renderer.eos_token_id else ids)

    def answer(self, conversations: list[list[dict]], generation: dict[str, Any], batch: int = 16,
               progress: bool = True) -> tuple[list[dict], dict]:
        """Every conversation's answer ({messages, answer, ids, stopped_by}) and the timing."""
        prompts = self.prompt_ids(conversations, generation["max_new_tokens"])
        rows, start = [], time.perf_counter()
        for first in tqdm(range(0, len(prompts), batch), desc="answer", unit="batch", disable=not progress):
            answers = self.decoder.generate(prompts[first:first + batch], eos_token_id=self.renderer.eos_token_id,
                                            **generation)
            for offset, ids in enumerate(answers):
                index = first + offset
                rows.append({"index": index, "messages": conversations[index], "answer": self.answer_text(ids),
                             "answer_ids": ids, "prompt_tokens": len(prompts[index]),
                             "stopped_by": "eos" if ids[-1] == self.renderer.eos_token_id else "max_new_tokens"})
        seconds = time.perf_counter() - start  # the answers are host lists: the device has finished
        new_tokens = sum(len(row["answer_ids"]) for row in rows)
        return rows, {"seconds": seconds, "new_tokens": new_tokens, "tokens_per_s": new_tokens / seconds,
                      "includes": "prompt rendering, prefill, decoding (and CUDA graph capture on a GPU)"}

    def reply(self, messages: list[dict], generation: dict[str, Any], on_text: Callable[[str], None]) -> str:
        """The next assistant turn of `messages`, its text handed to on_text as it grows."""
        prompt = self.prompt_ids([conversation_to_answer({"messages": messages}, "conversation")],
                                 generation["max_new_tokens"])
        ids: list[int] = []

        def grow(_: int, token: int) -> None:
            ids.append(token)
            on_text(self.answer_text(ids))

        answer = self.decoder.generate(prompt, eos_token_id=self.renderer.eos_token_id, stream=grow, **generation)
        return self.answer_text(answer[0])

    def describe(self) -> dict[str, Any]:
        tokenizer = {**tokenizer_record(self.tokenizer), "vocab_size": self.tokenizer.vocab_size}
        weights = self.checkpoint / (ADAPTER_WEIGHTS_FILE if self.adapters else WEIGHTS_FILE)
        return {"checkpoint": {"path": str(self.checkpoint), "sha256": sha256_file(weights),
                               "lora_adapters_merged": self.adapters,
                               "base_matches_training": self.base_matches_training,
                               "config": self.model.config.to_dict(), **count_parameters(self.model)},
                "tokenizer": tokenizer, "template": self.renderer.record(), "eos_token_id": self.renderer.eos_token_id}


@dataclass
class Chat:
    """A checked chat job: the session, the conversations to answer and where the answers go."""

    session: ChatSession
    conversations: list[list[dict]]
    out_dir: Path
    trained_here: bool  # no checkpoint was named: out_dir/trained-here holds the run


def prepare_chat(params: ChatParams) -> Chat:
    """Check the prompts, tokenizer, template and out_dir, then load the checkpoint (or train one under
    out_dir when none is named) and check every prompt against it: a bad input stops here, before any answer."""
    out_dir = job_out_dir(params.out_dir, "chat", ("answers.jsonl",), "answers")
    refuse_links(out_dir, ("trained-here",))
    conversations = read_conversations(params.prompts)
    renderer = chat_renderer(params.tokenizer, params.template)
    for messages in conversations:
        renderer.render_prompt(messages)
    checkpoint = params.checkpoint
    if checkpoint is None:
        if params.tokenizer != "byte" or getattr(renderer, "template", None) != ChatTemplate():
            raise ParamError("checkpoint None trains a model here on the embedded tasks, which use the byte "
                             "tokenizer and the default template: name a checkpoint for another tokenizer or template")
        checkpoint, _ = train_here(out_dir / "trained-here", params.train_steps, params.device, params.seed or 0)
    session = ChatSession(checkpoint, params.tokenizer, params.template, params.device, params.bf16)
    session.prompt_ids(conversations, params.max_new_tokens)
    return Chat(session, conversations, out_dir, trained_here=params.checkpoint is None)


def answer_prompts(chat: Chat, params: ChatParams) -> dict:
    """Answer every conversation; write out_dir/answers.jsonl and out_dir/record.json."""
    session, out_dir = chat.session, chat.out_dir
    rows, timing = session.answer(chat.conversations, params.generation())
    out_dir.mkdir(parents=True, exist_ok=True)
    try:  # published only where no answers are yet: a second chat into out_dir never replaces the first's
        with atomic_file(out_dir / "answers.jsonl", replace=False) as staging, open(staging, "w") as out:
            out.writelines(json.dumps(row, ensure_ascii=False) + "\n" for row in rows)
    except FileExistsError as err:
        raise ParamError(f"out_dir {out_dir}: {err}: another chat wrote its answers there meanwhile; nothing of "
                         "this one was written") from None
    record = {**record_header("chat", session.device, out_dir),
              **session.describe(), "generation": params.generation(),
              "precision": "bf16-autocast" if params.bf16 else "fp32", "decoder": session.decoder.path(),
              "prompts": {"source": params.prompts if isinstance(params.prompts, str) else "inline list",
                          "conversations": len(rows)},
              "timing": timing, "answers": str(out_dir / "answers.jsonl")}
    write_json_atomic(out_dir / "record.json", record)
    return record


def show_answers_of(rows_path: str | Path, limit: int = 20) -> None:
    """Each prompt's last user turn and its answer, one pair per line, for the first `limit` rows. Read a row at a
    time, each bounded, from a regular file only (cflib.jsonio): the rows past `limit` are never parsed, and a
    FIFO in the file's place is refused rather than waited on."""
    for _, row in itertools.islice(json_lines(Path(rows_path), ParamError), limit):
        print(f"{row['messages'][-1]['content']!r:40} -> {row['answer']!r} ({row['stopped_by']})")


def headline(record: dict) -> str:
    """One deterministic line (what nbval compares for the default parameters)."""
    checkpoint, generation = record["checkpoint"], record["generation"]
    mode = "greedy" if generation["temperature"] == 0 else f"sampled at temperature {generation['temperature']}"
    return (f"{record['prompts']['conversations']} conversations answered ({mode}, up to "
            f"{generation['max_new_tokens']} new tokens) by a {checkpoint['params_total']:,}-parameter model, "
            f"vocabulary {checkpoint['config']['vocab_size']}, {record['tokenizer']['kind']} tokenizer")
