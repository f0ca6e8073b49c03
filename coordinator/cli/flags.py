"""The flags several ``strata`` commands share, their checks, and how a command resolves its engine settings.

Every command that opens an engine resolves its settings through ``engine_config``: a flag over its
``STRATA_*`` variable over the default (CLI_DEFAULTS, then EngineConfig's). The flags' help texts take their
defaults from the same places, and the sampling flags theirs from coordinator/request.py.
"""

from __future__ import annotations

import argparse
import os
import re
from pathlib import Path
from typing import Mapping

from ..config import (ACTIVATIONS, DENSE_DTYPES, ENV_VARS, EXPERT_DTYPES, KV_DTYPES, SPECULATIVE_MODES, EngineConfig,
                      resolve_config)
from ..errors import ConfigValueError
from ..request import DEFAULT_MAX_NEW_TOKENS, GenerateRequest

CLI_DEFAULTS = {"pool": "process"}  # the command line runs real node workers; the library defaults to inproc

# EngineConfig fields the engine flags set ("--" + the field, dashed); the others only through their variable
FLAG_FIELDS = ("numa_split", "nodes", "pool", "pool_node", "worker_threads", "keep_shm", "route_tail_skip", "max_seq_len",
               "worker_hang_timeout", "worker_restart_window", "expert_dtype", "dense_dtype", "kv_dtype",
               "activations", "prefill_chunk", "device", "expert_profile", "gpu_experts", "gpu_expert_memory",
               "speculative", "draft_max", "graph", "graph_capture", "batch_invariant")


def number(kind, name: str, low=None, high=None, low_open: bool = False):
    """An argparse type: a number of ``kind`` within [low, high] ((low, high] when low_open), refused at parse
    time, before anything loads, with the bound named (argparse exits 2)."""

    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not {'an integer' if kind is int else 'a number'}")
        if value != value or (low is not None and (value <= low if low_open else value < low)) or \
                (high is not None and value > high):
            bounds = f"{'(' if low_open else '['}{low if low is not None else '-inf'}, " \
                     f"{high if high is not None else 'inf'}]"
            raise argparse.ArgumentTypeError(f"{name} must be in {bounds}, got {text}")
        return value

    return parse


def non_empty(name: str):
    """An argparse type: a non-empty string."""
    def parse(value: str) -> str:
        if not value:
            raise argparse.ArgumentTypeError(f"{name} is empty: give some text to continue")
        return value

    return parse


def writable_file(value: str) -> Path:
    """An output path whose folder exists and can be written, checked before the run (not after it)."""
    path = Path(value)
    folder = path.parent if str(path.parent) else Path(".")
    if not folder.is_dir():
        raise argparse.ArgumentTypeError(f"{value}: folder {folder} does not exist")
    if not os.access(folder, os.W_OK):
        raise argparse.ArgumentTypeError(f"{value}: folder {folder} is not writable")
    if path.is_dir():
        raise argparse.ArgumentTypeError(f"{value} is a folder; give a file name")
    return path


def readable_file(value: str) -> Path:
    path = Path(value)
    if not path.is_file():
        raise argparse.ArgumentTypeError(f"{value}: no such file")
    return path


def host_port(value: str) -> tuple[str, int]:
    """HOST:PORT ([V6]:PORT for IPv6; port 0 = any free one) -> (host, port)."""
    host, sep, port = value.rpartition(":")
    host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    if not sep or not host or not port.isdigit() or int(port) > 65535:
        raise argparse.ArgumentTypeError(f"{value!r} is not HOST:PORT (e.g. 127.0.0.1:8000)")
    return host, int(port)


def setting(field: str, none: str = "none") -> str:
    """The end of an engine flag's help: "(STRATA_VAR; default X)", X the command line's default for the field
    (CLI_DEFAULTS, else EngineConfig's); ``none`` says what a default of None means."""
    value = CLI_DEFAULTS.get(field, getattr(EngineConfig, field))
    if value is None:
        shown = none
    elif isinstance(value, bool):
        shown = "on" if value else "off"
    elif isinstance(value, float):
        shown = f"{value:g}"
    else:
        shown = str(value)
    return f"({ENV_VARS[field][0]}; default {shown})"


def add_engine_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("engine (flag > STRATA_* variable > default)")
    g.add_argument("--numa-split", dest="numa_split", action="store_true", default=None,
                   help="cut every CPU expert by rows across the NUMA nodes " + setting("numa_split"))
    g.add_argument("--nodes", type=int, default=None,
                   help="nodes in split mode; virtual when the machine has fewer "
                        + setting("nodes", "every real node"))
    g.add_argument("--pool", default=None, choices=["process", "inproc"],
                   help=f"process: one node worker process per node; inproc: in this process {setting('pool')}")
    g.add_argument("--pool-node", dest="pool_node", type=int, default=None,
                   help="the node of non-split mode " + setting("pool_node"))
    g.add_argument("-t", "--worker-threads", dest="worker_threads", type=number(int, "--worker-threads", 1),
                   default=None, help="threads per node worker " + setting("worker_threads", "the node's CPUs"))
    g.add_argument("--keep-shm", dest="keep_shm", action="store_true", default=None,
                   help="leave the segments in /dev/shm at exit for a fast restart " + setting("keep_shm"))
    g.add_argument("--route-tail-skip", dest="route_tail_skip", type=float, default=None,
                   help="drop routed experts whose weight is below this (0 = off) " + setting("route_tail_skip"))
    g.add_argument("-c", "--ctx-size", "--max-seq-len", dest="max_seq_len", type=number(int, "--ctx-size", 1),
                   default=None, help="the context: the longest sequence, prompt and new tokens "
                                      + setting("max_seq_len", "the model's max_position_embeddings"))
    g.add_argument("--worker-hang-timeout", dest="worker_hang_timeout", type=float, default=None,
                   help="seconds a node worker may stay silent on one layer before it is declared hung, killed and "
                        "restarted " + setting("worker_hang_timeout", "derived from the measured layer time"))
    g.add_argument("--worker-restart-window", dest="worker_restart_window", type=float, default=None,
                   help="a second worker death within this many seconds is not restarted until it has passed "
                        + setting("worker_restart_window"))
    g.add_argument("--expert-dtype", dest="expert_dtype", default=None, choices=list(EXPERT_DTYPES),
                   help="how the CPU experts are stored: auto (bf16 for a BF16 checkpoint, f32 for F16/F32, a GGUF "
                        "file's Q8_0/Q4_0/Q4_K/Q5_K/Q6_K blocks as they are, per tensor), f32, bf16, q8 (8-bit, f16 "
                        "scale per 32), q4 (4-bit, f16 scale per 32), or q4k/q5k/q6k (a GGUF file's K blocks, only "
                        "from that type) " + setting("expert_dtype"))
    g.add_argument("--dense-dtype", dest="dense_dtype", default=None, choices=list(DENSE_DTYPES),
                   help="how the dense matrices (attention, dense and shared MLPs, lm_head) are stored and read, on "
                        "the GPU as on the host: auto (the file's own: a GGUF file's Q8_0/Q4_0/K/IQ4_XS matrices as "
                        "the file has them, as llama.cpp reads them; on a GPU BF16/F16/FP8 as bf16, on the host "
                        "float32), f32, bf16, q8, q4 " + setting("dense_dtype"))
    g.add_argument("--kv-dtype", dest="kv_dtype", default=None, choices=list(KV_DTYPES),
                   help="the KV cache's values: auto (bf16 on a GPU, f32 on the host), f32, bf16 (a GPU's; the "
                        "host keeps f32) " + setting("kv_dtype"))
    add_activations_flag(g)
    add_invariance_flags(g)
    g.add_argument("--prefill-chunk", dest="prefill_chunk", type=int, default=None,
                   help="prompt tokens prefilled per serving step, interleaved with decoding "
                        + setting("prefill_chunk"))
    g.add_argument("--speculative", dest="speculative", default=None, choices=list(SPECULATIVE_MODES),
                   help="speculative decoding: off, ngram (drafts from earlier text: prompt lookup), mtp (drafts "
                        "from the model's multi-token-prediction layer: DeepSeek-V3, GLM-4.5, Qwen3-Next; refused "
                        "without one), auto (mtp where the model has the layer, else ngram); the output is the same "
                        "tokens (greedy) or the same distribution (sampling) "
                        + setting("speculative"))
    g.add_argument("--draft-max", dest="draft_max", type=number(int, "--draft-max", 1, 16), default=None,
                   help="drafts tried per step at most; fewer after misses, none for a while after "
                        "repeated ones " + setting("draft_max"))
    g.add_argument("--no-graph", dest="graph", action="store_false", default=None,
                   help="run every GPU decode step eagerly: the router's choice through the host, the pool waited "
                        "from Python (a sync a layer) " + setting("graph"))
    g.add_argument("--no-graph-capture", dest="graph_capture", action="store_false", default=None,
                   help="queue each graph-ready GPU decode step launch by launch instead of replaying it as a "
                        "captured CUDA graph " + setting("graph_capture"))
    add_device_flags(g)
    g.add_argument("--print-config", action="store_true", help="print the effective config and exit")


def add_activations_flag(g) -> None:
    g.add_argument("--activations", dest="activations", default=None, choices=list(ACTIVATIONS),
                   help="dot products with quantised experts and dense matrices: q8 multiplies the weights' "
                        "integers by the activations quantised to int8 (per block of 32 for q8 and q4, per 256 for "
                        "the K types and IQ4_XS), as llama.cpp does; f32 widens the weights to float32, the "
                        "reference " + setting("activations"))


def add_invariance_flags(g) -> None:
    g.add_argument("--batch-invariant", dest="batch_invariant", action="store_true", default=None,
                   help="sum every row of a step in an order fixed by the row alone, so a sequence's logits are the "
                        "same bits alone, in a batch, with drafts or prefilled in chunks " + setting("batch_invariant"))
    g.add_argument("--no-batch-invariant", dest="batch_invariant", action="store_false", default=None,
                   help="take BLAS and the chunked linear attention where they are faster for many rows (a row's "
                        "last bits then depend on the rows beside it)")


def add_device_flags(g) -> None:
    g.add_argument("--device", default=None, choices=["auto", "cpu", "cuda"],
                   help="where the device side runs: auto (a GPU if usable), cpu, cuda " + setting("device"))
    g.add_argument("--expert-profile", dest="expert_profile", default=None,
                   help="a profile from `strata profile` " + setting("expert_profile"))
    g.add_argument("--gpu-experts", dest="gpu_experts", type=int, default=None,
                   help="keep this many experts whole on the device (hottest with a profile) " + setting("gpu_experts"))
    g.add_argument("--gpu-expert-memory", dest="gpu_expert_memory", type=float, default=None,
                   help="or as many of the profile's hottest experts as fit in this many GB "
                        + setting("gpu_expert_memory"))


def add_sampling_flags(p: argparse.ArgumentParser) -> None:
    """The sampling and stopping flags of every command that generates: the same names (llama.cpp's where it
    has them), checks and defaults (a request's own: coordinator/request.py)."""
    G = GenerateRequest
    p.add_argument("-n", "--max-new-tokens", "--n-predict", dest="max_new_tokens",
                   type=number(int, "--max-new-tokens", 1), default=DEFAULT_MAX_NEW_TOKENS,
                   help="the most tokens to generate (default %(default)s)")
    p.add_argument("--temp", "--temperature", dest="temperature", type=number(float, "--temperature", 0.0),
                   default=G.temperature, help="0 is greedy (default %(default)s)")
    p.add_argument("--top-k", dest="top_k", type=number(int, "--top-k", 0), default=G.top_k,
                   help="sample from the k most likely tokens; 0 = all (default %(default)s)")
    p.add_argument("--top-p", dest="top_p", type=number(float, "--top-p", 0.0, 1.0, low_open=True), default=G.top_p,
                   help="sample from the smallest set of tokens whose probabilities reach p (default %(default)s)")
    p.add_argument("--min-p", dest="min_p", type=number(float, "--min-p", 0.0, 1.0), default=G.min_p,
                   help="drop the tokens less likely than min-p times the most likely one; 0 = off (default "
                        "%(default)s)")
    p.add_argument("--repeat-penalty", "--repetition-penalty", dest="repetition_penalty",
                   type=number(float, "--repeat-penalty", 0.0, low_open=True), default=G.repetition_penalty,
                   help="divide the positive logits (multiply the negative ones) of the tokens in the prompt and the "
                        "answer by this, as transformers' repetition_penalty; 1 = off (default %(default)s)")
    p.add_argument("-s", "--seed", type=int, default=G.seed, help="for reproducible sampling (default: random)")
    p.add_argument("--stop", action="append", default=None, type=non_empty("--stop"),
                   help="end the answer before this text (repeatable; default: none)")


def sampling_options(args: argparse.Namespace) -> dict:
    """The sampling and stopping flags as Engine.generate_full's options."""
    return {"top_k": args.top_k, "top_p": args.top_p, "min_p": args.min_p, "seed": args.seed,
            "repetition_penalty": args.repetition_penalty, "stop": tuple(args.stop or ())}


def in_users_words(message: str, flags: dict) -> str:
    """An EngineConfig message in the words the user typed: ``field=value`` as ``--flag value`` (``--flag`` for
    True) or, where the value came from its variable or the field has no flag, ``STRATA_VAR=value``; a field's
    bare name likewise where it cannot be an ordinary word (it has an underscore, or starts the message)."""
    def name(field: str) -> str:
        var = ENV_VARS[field][0]
        return var if field not in FLAG_FIELDS or (flags.get(field) is None and var in os.environ) \
            else "--" + field.replace("_", "-")

    for field in sorted(ENV_VARS, key=len, reverse=True):
        who = name(field)
        joiner = "=" if who.startswith("STRATA_") else " "

        def assigned(m: re.Match, who=who, joiner=joiner) -> str:
            value = m.group(1)
            return who if value == "True" and joiner == " " else f"{who}{joiner}{value}"

        message = re.sub(rf"(?<![\w-]){field}=([^\s,;)]+)", assigned, message)
        if "_" in field:
            message = re.sub(rf"(?<![\w-]){field}(?![\w=])", who, message)
        elif message.startswith(field + " "):  # an ordinary word elsewhere ("at most 2 nodes")
            message = who + message[len(field):]
    return message


def engine_config(args: argparse.Namespace, check: bool = True, fixed: Mapping[str, object] | None = None,
                  environ: Mapping[str, str] | None = None) -> tuple[EngineConfig, dict[str, str]]:
    """A command's effective config and where each value came from, the same way for every command: the flag
    (``args``' attribute of the field's name) over its STRATA_* variable over the default. ``fixed``: fields the
    command sets itself (strata bench's modes), their flags and variables not read. With ``check`` a split over
    more nodes than CPUs is refused here, before anything loads. Errors name the flags (or variables) the user
    gave, not EngineConfig's fields."""
    from ..cpu_experts import refuse_shared_cpus

    environ = os.environ if environ is None else environ
    flags = {name: getattr(args, name, None) for name in ENV_VARS}
    if fixed:
        flags.update(fixed)
        environ = {k: v for k, v in environ.items() if k not in {ENV_VARS[name][0] for name in fixed}}
    try:
        config, sources = resolve_config(flags, environ, defaults=CLI_DEFAULTS)
        if check and config.numa_split and not getattr(args, "print_config", False):
            refuse_shared_cpus(config.nodes)
    except ConfigValueError as exc:
        raise ConfigValueError(in_users_words(str(exc), flags)) from None
    for name in fixed or ():
        sources[name] = "the command"
    return config, sources


def print_config(config: EngineConfig, sources: dict[str, str]) -> None:
    for name, (var, _) in ENV_VARS.items():
        print(f"{name:16} {getattr(config, name)!r:12} ({sources[name]}; variable {var})")
