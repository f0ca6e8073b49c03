"""The ``strata`` command line."""

from __future__ import annotations

import argparse
import json
import logging
import shutil
import sys
from pathlib import Path

from shm.checkpoint import CheckpointError

from ..config import API_KEY_VAR, DENSE_DTYPES, EXPERT_DTYPES, SPECULATIVE_MODES, resolve_api_key
from ..errors import StrataError
from ..model.arch import FAMILIES
from ..request import (DEFAULT_MAX_ACTIVE, DEFAULT_MAX_NEW_TOKENS, DEFAULT_MAX_NEW_TOKENS_LIMIT,
                       DEFAULT_MAX_PROMPT_TOKENS, DEFAULT_MAX_QUEUED)
from ..serving.api import DEFAULT_ADDRESS, DEFAULT_HTTP_HEADER_TIMEOUT_S
from .chat import add_chat_command
from .flags import (add_activations_flag, add_device_flags, add_engine_flags, add_invariance_flags, add_sampling_flags,
                    engine_config, host_port, non_empty, number, print_config, readable_file, sampling_options, setting,
                    writable_file)
from .make_model import PRESETS

log = logging.getLogger("strata")


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("strata-numa")
    except PackageNotFoundError:
        return "unknown (not installed)"


def cmd_make_model(args: argparse.Namespace) -> int:
    from shm.paths import write_problem

    from .make_model import make_model

    overrides = {"num_layers": args.layers} if args.layers else {}
    if args.experts:  # fewer routed experts: a real geometry's layers within a small machine's memory
        top_k = PRESETS[args.preset]().top_k
        overrides.update(num_experts=args.experts, top_k=min(top_k, args.experts))
    out: Path = args.out
    if out.exists() and not out.is_dir():
        raise StrataError(f"--out {out} is a file; give a folder to write the model into (--force replaces a "
                          "folder, never a file)")
    replacing = out.is_dir() and any(out.iterdir())
    if replacing and not args.force:
        raise StrataError(f"--out {out} is not an empty folder; pass --force to replace it whole")
    made = not out.exists()
    problem = write_problem(out)
    if problem:
        raise StrataError(f"--out {out}: the folder cannot be written ({problem})")
    try:
        if replacing:
            shutil.rmtree(out)  # whole: no shard or index of the old model left to be loaded with the new
        written = make_model(out, preset=args.preset, arch=args.arch, seed=args.seed, dtype=args.dtype,
                             max_shard_bytes=args.max_shard_bytes, **overrides)
    except OSError as exc:  # the disk filled up, or the folder went away, while writing
        if made or replacing:
            shutil.rmtree(out, ignore_errors=True)  # no half-written model left to be loaded
        raise StrataError(f"cannot write the model into {out}: {exc.strerror or exc}") from None
    except BaseException:
        if made:
            shutil.rmtree(out, ignore_errors=True)
        raise
    arch = json.loads((written / "config.json").read_text())["model_type"]
    print(f"wrote {args.preset} {arch} model (seed {args.seed}, {args.dtype}) to {written}")
    return 0


def _given_ids(args: argparse.Namespace) -> list[int] | None:
    """--prompt-ids as integers (None for a text prompt)."""
    if args.prompt_ids is None:
        return None
    try:
        ids = [int(t) for t in args.prompt_ids.split(",") if t.strip()]
    except ValueError:
        raise StrataError(f"--prompt-ids {args.prompt_ids!r}: expected comma-separated integers") from None
    if not ids:
        raise StrataError("--prompt-ids is empty: give at least one token id")
    return ids


def read_text(path: Path, flag: str) -> str:
    """A text file a flag names, UTF-8; one that cannot be read is a StrataError naming the flag and the cause."""
    try:
        return path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise StrataError(f"{flag} {path}: cannot be read: {exc}") from None


def _prompt_text(args: argparse.Namespace) -> str:
    """The prompt: --prompt's text, stdin's for ``-p -``, or --file's."""
    if args.file is not None:
        text, where = read_text(args.file, "--file"), f"--file {args.file}"
    elif args.prompt == "-":
        text, where = sys.stdin.read(), "standard input (-p -)"
    else:
        text, where = args.prompt, "--prompt"
    if not text:
        raise StrataError(f"the prompt from {where} is empty: give some text to continue")
    return text


def cmd_generate(args: argparse.Namespace) -> int:
    from ..engine import Engine, check_prompt_ids
    from ..model.source import open_source

    config, sources = engine_config(args)
    if args.print_config:
        print_config(config, sources)
        return 0
    source = open_source(args.model)  # the prompt checked against the configuration before the weights load
    ids = _given_ids(args)
    if ids is None:
        if source.codec is None:
            raise StrataError(f"{args.model} has no tokenizer; pass token ids (--prompt-ids) instead of text")
        ids = source.codec.encode(_prompt_text(args))
    check_prompt_ids(source.config, ids, args.max_new_tokens, config.max_seq_len)
    if args.stop and source.codec is None:
        raise StrataError(f"{args.model} has no tokenizer: --stop needs text to look for")
    with Engine.open(args.model, config, source, quiet=args.quiet) as engine:
        if not args.quiet:
            print(engine.pool_description(), file=sys.stderr)
        streaming = engine.codec is not None and not args.json

        def on_text(piece: str) -> None:
            sys.stdout.write(piece)
            sys.stdout.flush()

        result = engine.generate_full(ids, args.max_new_tokens, args.temperature,
                                      on_text=on_text if streaming else None, **sampling_options(args))
        timings = {"load_s": engine.load_s, "compile_s": engine.compile_s, **result.timings}
        if args.json:
            health, stats = engine.health(), engine.stats()
            doc = {
                "prompt_ids": result.prompt_ids, "ids": result.ids, "text": result.text,
                "finish_reason": result.finish_reason, "timing": timings,
                "experts": stats["experts"],
                "kv_bytes_per_token": engine.model_config.kv_bytes_per_token,  # float32, the attention layers
                "state_bytes_per_sequence": engine.model_config.state_bytes_per_sequence,  # Gated DeltaNet layers
                "pool": {"kind": health["kind"], "numa_split": config.numa_split, "plan": health["plan"],
                         "nodes": list(engine.cpu.plan.node_ids), "node_info": [n.as_dict() for n in engine.nodes]},
                "routing": {"routed_pairs": stats["routed_pairs"], "skipped_pairs": stats["skipped_pairs"]},
            }
            print(json.dumps(doc))
        elif streaming:
            sys.stdout.write("\n")
        else:
            print(",".join(str(t) for t in result.ids))
        sys.stdout.flush()
        print(speed_line(timings), file=sys.stderr)  # after the text, as llama.cpp ends a run
    return 0


def speed_line(t: dict) -> str:
    """llama.cpp's summary after a generation: the load (and the kernels compiled on a first run), prompt and
    decode speeds, time to the first token."""
    def rate(tokens: int, seconds: float) -> str:
        if seconds <= 0:
            return f"{tokens} tokens"
        return f"{tokens} tokens in {seconds:.2f} s ({tokens / seconds:.1f} tok/s)"

    load = ""
    if "load_s" in t:
        compiled = f" (of which compiling kernels {t['compile_s']:.1f} s, first run)" if t.get("compile_s") else ""
        load = f"load {t['load_s']:.1f} s{compiled} | "
    drafts = ""
    if t.get("drafted_tokens"):  # speculative decoding: what share of the drafts stood
        drafts = f" | drafts accepted {t['accepted_drafts']} of {t['drafted_tokens']}"
    return (f"{load}prompt: {rate(t['prefill_tokens'], t['prefill_s'])} | decode: "
            f"{rate(t['decode_tokens'], t['decode_s'])}{drafts} | time to first token "
            f"{t['time_to_first_token_s']:.2f} s")


def cmd_topo(args: argparse.Namespace) -> int:
    from shm.topology import format_table, real_nodes, select_nodes

    nodes = select_nodes(args.nodes) if args.nodes else real_nodes()
    if args.json:
        print(json.dumps({"nodes": [n.as_dict() for n in nodes]}, indent=2))
    else:
        print(format_table(nodes))
    return 0


def cmd_shm_list(args: argparse.Namespace) -> int:
    from shm.placement import owner_node, segment_placement
    from shm.segments import list_segments

    rows = []
    for info in list_segments():
        h = info.header
        row = {"name": info.name, "size": info.size, "error": info.error}
        if h is not None:
            row.update(node=h.node, owner_pid=h.owner_pid, owner_alive=info.owner_alive, model=h.model_digest,
                       plan=h.plan_digest, state="complete" if h.complete else "partial")
            if args.placement and info.owner_alive:
                placement = segment_placement(h.owner_pid, info.name, owner_node(h.owner_pid, h.node))
                row["placement"] = placement.as_dict() if placement else None
        rows.append(row)
    from ..pool.channel import pool_dirs

    folders = [{"folder": str(f), "owner_alive": alive} for f, alive in pool_dirs()]
    if args.json:
        print(json.dumps({"segments": rows, "pool_folders": folders}, indent=2))
        return 0
    for f in folders:  # a coordinator's private folder (job.json, the socket); a dead one's goes with shm clean --all
        state = "alive" if f["owner_alive"] else "gone: strata shm clean --all"
        print(f"{f['folder']}  pool folder  coordinator {state}")
    if not rows:
        print("no strata segments in /dev/shm")
    for r in rows:
        if r["error"]:
            print(f"{r['name']}  {r['size'] / 2**20:.1f} MiB  unreadable: {r['error']}")
            continue
        line = (f"{r['name']}  {r['size'] / 2**20:.1f} MiB  node {r['node']}  {r['state']}  model {r['model']}  "
                f"plan {r['plan']}  owner {r['owner_pid']} ({'alive' if r['owner_alive'] else 'dead'})")
        p = r.get("placement")
        if p and p["local_share"] is not None:
            line += f"  local pages {p['local_share']:.1%} of {p['pages']}"
        print(line)
    return 0


def cmd_shm_clean(args: argparse.Namespace) -> int:
    from shm.segments import clean

    from ..pool.channel import remove_stale_pool_dirs

    if not args.all and not args.names:
        print("strata: error: name the segments to remove, or pass --all", file=sys.stderr)
        return 2
    results = clean(None if args.all else args.names, force=args.force)
    for name, what in results:
        print(f"{name}: {what}")
    if args.all:
        for folder in remove_stale_pool_dirs():
            print(f"{folder}: removed (its coordinator is gone)")
    return 1 if any(w.startswith("kept") or w == "no such segment" for _, w in results) else 0


def cmd_serve(args: argparse.Namespace) -> int:
    from ..engine import Engine
    from ..request import Limits
    from ..serving.server import BindRefused, check_bind, serve

    config, sources = engine_config(args)
    if args.print_config:
        print_config(config, sources)
        return 0
    bind = args.bind
    if bind is None:  # the clients' default address, or any free port when another server holds it
        try:
            check_bind(DEFAULT_ADDRESS, False, False)
            bind = DEFAULT_ADDRESS
        except BindRefused:
            bind = f"{DEFAULT_ADDRESS.rsplit(':', 1)[0]}:*"
            print(f"strata: {DEFAULT_ADDRESS} is in use (another server?); this one takes a free port, named on "
                  "its 'serving on' line (give clients --address)", file=sys.stderr)
    check_bind(bind, args.curve_keys is not None, args.insecure_remote)  # before loading anything
    http = None
    if args.http is not None:
        host, port = args.http
        check_bind(f"tcp://{'[' + host + ']' if ':' in host else host}:{port}", False, args.insecure_remote,
                   remedy="Give --insecure-remote to serve anyone who can reach it (with --api-key to ask a key)")
        http = {"host": host, "port": port, "api_key": resolve_api_key(args.api_key),
                "model_name": args.served_model_name or args.model.name,
                "header_timeout_s": args.http_header_timeout, "cors": tuple(args.cors)}
    for name in ("coordinator.serving", "coordinator.scheduler"):  # one line per request, -v or not
        logging.getLogger(name).setLevel(logging.INFO)
    with Engine.open(args.model, config, quiet=args.quiet) as engine:
        if not args.quiet:
            print(engine.pool_description(), file=sys.stderr)
        limits = Limits(max_new_tokens=args.max_new_tokens_limit, max_prompt_tokens=args.max_prompt_tokens)
        return serve(engine, bind, http=http, limits=limits, max_active=args.max_active,
                     max_queued=args.max_queued, curve_keys=args.curve_keys, insecure_remote=args.insecure_remote)


def cmd_client(args: argparse.Namespace) -> int:
    from ..serving.client import Client

    params = dict(max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_k=args.top_k,
                  top_p=args.top_p, min_p=args.min_p, repetition_penalty=args.repetition_penalty, stream=not args.json)
    if args.seed is not None:
        params["seed"] = args.seed
    if args.stop:
        params["stop"] = args.stop
    with Client(args.address, timeout=args.timeout, curve_keys=args.curve_keys) as c:
        gen = c.generate(args.prompt, **params)
        for piece in gen:
            sys.stdout.write(piece)
            sys.stdout.flush()
        if args.json:
            print(json.dumps(gen.final))
        else:
            print()
    return 0


def cmd_bench(args: argparse.Namespace) -> int:
    from .bench import (MODES, BenchPlan, bench_engines, markdown, parse_formats, plot, plot_available, run_bench,
                        with_invariance, write_json)

    if args.plot and plot_available():  # before minutes of measuring, not after
        raise StrataError(plot_available())
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    bad = [m for m in modes if m not in MODES]
    if bad:
        raise StrataError(f"--modes: unknown mode(s) {', '.join(bad)}; expected some of {', '.join(MODES)}")
    formats = parse_formats(args.formats) if args.formats is not None else None
    if formats and (args.expert_dtype or args.dense_dtype):
        raise StrataError("--formats sets the storage formats of every engine: give it without --expert-dtype "
                          "and --dense-dtype (an entry EXPERTS+DENSE gives both)")
    if args.invariance == "both":
        if args.batch_invariant is not None:
            raise StrataError("--invariance both measures each engine with batch-invariant numerics and without: "
                              "give it without --batch-invariant or --no-batch-invariant")
        formats = with_invariance(formats)
    given: dict = {}  # the settings that came from a flag or a variable, not set by a mode or format

    def resolve(fixed: dict):
        config, sources = engine_config(args, fixed=fixed)
        given.update({name: getattr(config, name) for name, source in sources.items()
                      if source == "flag" or source.startswith("env ")})
        return config

    if args.prompt_file is not None and args.repetitive:
        raise StrataError("--prompt-file and --repetitive each choose the prompt: give one")
    prompt_text = read_text(args.prompt_file, "--prompt-file") if args.prompt_file is not None else None
    engines = bench_engines(modes, args.nodes, formats, resolve)
    report = run_bench(args.model, BenchPlan(engines, tuple(label for label, _ in formats or ()), given,
                                             tokens=args.tokens, prompt_tokens=args.prompt_tokens, rounds=args.rounds,
                                             quality_positions=args.quality_positions, speculative=args.bench_speculative,
                                             repetitive=args.repetitive, prompt_text=prompt_text,
                                             temperature=args.bench_temperature))
    print(markdown(report))
    if args.json:
        write_json(report, args.json)
    if args.plot:
        plot(report, args.plot)
    return 0


def cmd_profile(args: argparse.Namespace) -> int:
    from ..engine import Engine

    config, _ = engine_config(args)
    prompts = [line for line in Path(args.prompts).read_text().splitlines() if line.strip()]
    if not prompts:
        raise StrataError(f"{args.prompts}: no prompts (one per line)")
    with Engine.open(args.model, config, quiet=args.quiet) as engine:
        tokens = 0
        for text in prompts:
            r = engine.generate_full(engine.encode(text), args.max_new_tokens)
            tokens += len(r.prompt_ids) + len(r.ids)
        profile = engine.profile()
    profile = type(profile)(**{**profile.__dict__, "prompts": len(prompts), "tokens": tokens})
    profile.save(args.out)
    print(f"profiled {len(prompts)} prompts ({tokens} tokens) into {args.out}")
    return 0


def _mb(n: int) -> str:
    return f"{n / 1e6:.0f} MB" if n >= 1e6 else f"{n / 1e3:.0f} kB"


def cmd_cache(args: argparse.Namespace) -> int:
    """Where the compiled kernels are kept, how large, and what this build has compiled (coordinator/warmup.py)."""
    from ..warmup import cache_report

    report = cache_report()
    if args.json:
        print(json.dumps(report, indent=2))
        return 0
    print(f"kernel cache: {report['root']}")
    print(f"this build:   {report['build']} ({report['describe']}), {_mb(report['build_bytes'])}")
    if not report["units"]:
        print("  nothing compiled yet: the first run of a model compiles what it needs")
    for u in report["units"]:
        print(f"  {u['label']:<44} {u['seconds']:7.1f} s  {u['functions']:4d} functions  peak {u['peak_mb']} MB  "
              f"{u['finished']}")
    others = report["other_builds"]
    if others:
        total = sum(o["bytes"] for o in others)
        print(f"other builds: {len(others)} folder{'s' if len(others) > 1 else ''}, {_mb(total)} (other sources, "
              "numba versions or CPUs): `strata cache clear --others` removes them")
    return 0


def cmd_cache_clear(args: argparse.Namespace) -> int:
    from shm import jit

    from ..warmup import folder_bytes, legacy_folders, remove_build_folders

    root = jit.cache_root()
    sizes = {f: folder_bytes(f) for f in [*(root.iterdir() if root.is_dir() else []), *legacy_folders()]
             if f.is_dir()}
    removed = remove_build_folders(root, keep=jit.build_dir().name if args.others else None)
    kept = [f for f in sizes if f not in removed and (not args.others or f.name != jit.build_dir().name)]
    print(f"removed {len(removed)} build folder{'' if len(removed) == 1 else 's'} "
          f"({_mb(sum(sizes[f] for f in removed))}) from {root}")
    if kept:
        print(f"kept {len(kept)} that another process is compiling into: {', '.join(f.name for f in kept)}")
    return 0


def cmd_config(args: argparse.Namespace) -> int:
    config, sources = engine_config(args, check=False)
    print_config(config, sources)
    return 0


def _add_make_model_command(sub, common) -> None:
    """strata make-model's flags."""
    p = sub.add_parser("make-model", help="write a deterministic random checkpoint", parents=[common])
    p.add_argument("--preset", default="tiny", choices=list(PRESETS),
                   help="the geometry: " + ", ".join(PRESETS) + " (default %(default)s)")
    p.add_argument("--out", required=True, type=Path, help="the folder to write (refused if it holds files)")
    p.add_argument("--force", action="store_true", help="replace a non-empty --out folder whole")
    p.add_argument("--seed", type=int, default=0, help="the random weights' seed (default %(default)s)")
    p.add_argument("--arch", default=None,
                   choices=[name for name, f in FAMILIES.items() if f.makeable],
                   help="default: the preset's own (qwen3_moe for tiny and bench-small)")
    p.add_argument("--dtype", default="F32", choices=["F32", "F16", "BF16"],
                   help="the checkpoint's tensor type (default %(default)s)")
    p.add_argument("--layers", type=int, default=None, help="override the preset's layer count (default: the preset's)")
    p.add_argument("--experts", type=int, default=None,
                   help="override the preset's routed experts per layer, top-k capped to it (default: the preset's)")
    p.add_argument("--max-shard-bytes", dest="max_shard_bytes", type=int, default=2 << 30,
                   help="cut the safetensors into shards of at most this size (default %(default)s)")
    p.set_defaults(func=cmd_make_model)


def _add_generate_command(sub, common) -> None:
    """strata generate's flags."""
    p = sub.add_parser("generate", help="generate text from a prompt", parents=[common])
    p.add_argument("-m", "--model", required=True, type=Path, help="a checkpoint folder or a GGUF file")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("-p", "--prompt", type=non_empty("--prompt"), help="the prompt text; - reads it from stdin")
    src.add_argument("-f", "--file", type=readable_file, help="read the prompt from this file")
    src.add_argument("--prompt-ids", dest="prompt_ids", help="the prompt as comma-separated token ids")
    add_sampling_flags(p)
    p.add_argument("--json", action="store_true", help="print one JSON object with ids, text and timing")
    add_engine_flags(p)
    p.set_defaults(func=cmd_generate)


def _add_serve_command(sub, common) -> None:
    """strata serve's flags."""
    p = sub.add_parser("serve", help="serve the ZeroMQ client API", parents=[common])
    p.add_argument("-m", "--model", required=True, type=Path, help="a checkpoint folder or a GGUF file")
    p.add_argument("--bind", default=None,
                   help=f"tcp://HOST:PORT (loopback; PORT * for any free one) or ipc://PATH (default {DEFAULT_ADDRESS}, "
                        "or a free port when another server holds it)")
    p.add_argument("--max-active", dest="max_active", type=int, default=DEFAULT_MAX_ACTIVE,
                   help="sequences decoded together (default %(default)s)")
    p.add_argument("--max-queued", dest="max_queued", type=int, default=DEFAULT_MAX_QUEUED,
                   help="waiting requests before 'busy' (default %(default)s)")
    p.add_argument("--max-new-tokens-limit", dest="max_new_tokens_limit", type=int,
                   default=DEFAULT_MAX_NEW_TOKENS_LIMIT,
                   help="the most max_new_tokens a request may ask for (default %(default)s)")
    p.add_argument("--max-prompt-tokens", dest="max_prompt_tokens", type=int, default=DEFAULT_MAX_PROMPT_TOKENS,
                   help="the longest prompt accepted, in tokens (default %(default)s)")
    p.add_argument("--curve-keys", dest="curve_keys", default=None,
                   help="folder with server.key_secret and clients/*.key: CURVE authentication (ZAP)")
    p.add_argument("--insecure-remote", dest="insecure_remote", action="store_true",
                   help="allow a non-loopback bind without authentication (ZeroMQ and HTTP)")
    p.add_argument("--http", type=host_port, default=None, metavar="HOST:PORT",
                   help="also serve the OpenAI-compatible HTTP API there (loopback unless --insecure-remote)")
    p.add_argument("--api-key", dest="api_key", default=None,
                   help=f"the Bearer token the HTTP API's /v1/* routes require (default: ${API_KEY_VAR}; none)")
    p.add_argument("--http-header-timeout", dest="http_header_timeout", default=DEFAULT_HTTP_HEADER_TIMEOUT_S, metavar="S",
                   type=number(float, "--http-header-timeout", 0, low_open=True),
                   help="close an HTTP connection that has not sent a whole request head within S seconds, and "
                        "an idle one after S (default %(default)s)")
    p.add_argument("--cors", action="append", default=[], metavar="ORIGIN",
                   help="let browser pages from ORIGIN (e.g. http://localhost:3000; * for any) call the HTTP API: "
                        "CORS headers and preflight answers; repeat for more origins (default: none)")
    p.add_argument("--served-model-name", dest="served_model_name", default=None,
                   help="the model id the HTTP API lists and accepts (default: the model's file or folder name)")
    add_engine_flags(p)
    p.set_defaults(func=cmd_serve)


def _add_client_command(sub, common) -> None:
    """strata client's flags."""
    p = sub.add_parser("client", help="send one prompt to a running server", parents=[common])
    p.add_argument("prompt", type=non_empty("the prompt"), help="the prompt text")
    p.add_argument("--address", default=DEFAULT_ADDRESS, help="the server's endpoint (default %(default)s)")
    add_sampling_flags(p)
    p.add_argument("--timeout", type=number(float, "--timeout", 0.0, low_open=True), default=30.0,
                   help="seconds to wait for the server before giving up (default %(default)s)")
    p.add_argument("--curve-keys", dest="curve_keys", default=None,
                   help="folder with server.key and client.key_secret: CURVE authentication (default: none)")
    p.add_argument("--json", action="store_true", help="print the final event as JSON")
    p.set_defaults(func=cmd_client)


def _add_bench_command(sub, common) -> None:
    """strata bench's flags."""
    p = sub.add_parser("bench", help="decode/prefill speed, pool overhead and bandwidth, modes side by side",
                       description="Each mode sets its pool (and split mode its nodes); every other engine setting "
                                   "comes from its flag, else its STRATA_* variable, else the default, as in every "
                                   "command (strata config lists them).", parents=[common])
    p.add_argument("-m", "--model", required=True, type=Path, help="a checkpoint folder or a GGUF file")
    p.add_argument("--modes", default="inproc,single,split",
                   help="comma-separated, measured side by side: inproc, single, split (default %(default)s)")
    p.add_argument("--nodes", type=number(int, "--nodes", 1), default=2,
                   help="nodes of the split mode (default %(default)s)")
    p.add_argument("--tokens", type=number(int, "--tokens", 2), default=64,
                   help="tokens decoded a round (default %(default)s)")
    p.add_argument("--prompt-tokens", dest="prompt_tokens", type=number(int, "--prompt-tokens", 1), default=256,
                   help="prompt tokens prefilled a round (default %(default)s)")
    p.add_argument("--rounds", type=number(int, "--rounds", 1), default=3,
                   help="interleaved rounds per mode (default %(default)s)")
    p.add_argument("--spin-us", dest="pool_spin_us", type=float, default=None,
                   help="how long a waiting side of the process modes polls before it blocks, in microseconds "
                        + setting("pool_spin_us"))
    add_device_flags(p.add_argument_group("device side, the same in every mode"))
    p.add_argument("--expert-dtype", dest="expert_dtype", default=None, choices=list(EXPERT_DTYPES),
                   help="how the CPU experts are stored in every mode " + setting("expert_dtype"))
    p.add_argument("--dense-dtype", dest="dense_dtype", default=None, choices=list(DENSE_DTYPES),
                   help="without a GPU, how the dense matrices are stored in every mode " + setting("dense_dtype"))
    p.add_argument("--formats", default=None,
                   help="comma-separated storage formats, each mode opened once per format and measured side "
                        "by side (mode@format), with decode and prefill as ratios to the first: FORMAT (experts "
                        "and dense matrices) or EXPERTS+DENSE, e.g. f32,bf16 or q4k+q8,q8 (instead of "
                        "--expert-dtype and --dense-dtype)")
    add_activations_flag(p)
    add_invariance_flags(p)
    p.add_argument("--invariance", default="given", choices=["given", "both"],
                   help="both: each engine (each mode and format) opened with batch-invariant numerics and without, "
                        "measured side by side (labels .../invariant and .../variable, ratios to the invariant one); "
                        "given: as --batch-invariant says (default %(default)s)")
    p.add_argument("--quality-positions", dest="quality_positions", type=int, default=128,
                   help="compare the logits over this many positions with an f32 computation of the same "
                        "checkpoint (max relative error, mean KL, top-1 agreement); 0: skip (default %(default)s)")
    p.add_argument("--speculative", dest="bench_speculative", default="off",
                   choices=[m for m in SPECULATIVE_MODES if m != "auto"],
                   help="also decode each round with this speculative decoding, side by side with plain decoding: "
                        "decode tok/s of both, their ratio, the drafts' acceptance rate and the tokens a step "
                        "makes (default %(default)s)")
    p.add_argument("--temp", dest="bench_temperature", type=number(float, "--temp", 0.0), default=0.0,
                   help="sample the decoded tokens at this temperature, seeded per round (default %(default)s: "
                        "greedy)")
    p.add_argument("--repetitive", action="store_true",
                   help="a prompt of one random 16-token phrase repeated (text prompt lookup can draft from) "
                        "instead of random tokens")
    p.add_argument("--prompt-file", dest="prompt_file", default=None, type=readable_file,
                   help="the prompt: this text file's first --prompt-tokens tokens (instead of random tokens)")
    p.add_argument("--json", default=None, type=writable_file, help="write every figure to this file")
    p.add_argument("--plot", default=None, type=writable_file,
                   help="draw tokens/s and the bandwidth ratio into this PNG (needs matplotlib)")
    p.set_defaults(func=cmd_bench)


def _add_profile_command(sub, common) -> None:
    """strata profile's flags."""
    p = sub.add_parser("profile", help="count the routing over prompts into a frozen expert profile",
                       parents=[common])
    p.add_argument("-m", "--model", required=True, type=Path, help="a checkpoint folder or a GGUF file")
    p.add_argument("--prompts", required=True, type=readable_file, help="a text file, one prompt per line")
    p.add_argument("--out", required=True, type=writable_file, help="the profile to write (JSON)")
    p.add_argument("-n", "--max-new-tokens", dest="max_new_tokens", type=number(int, "--max-new-tokens", 1),
                   default=DEFAULT_MAX_NEW_TOKENS, help="tokens generated after each prompt (default %(default)s)")
    add_engine_flags(p)
    p.set_defaults(func=cmd_profile)


def _add_topo_command(sub, common) -> None:
    """strata topo's flags."""
    p = sub.add_parser("topo", help="show the NUMA nodes, their CPUs and memory", parents=[common])
    p.add_argument("--nodes", type=int, default=None, help="show the nodes a split over N would use (virtual if needed)")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.set_defaults(func=cmd_topo)


def _add_shm_command(sub, common) -> None:
    """strata shm's flags."""
    shm_p = sub.add_parser("shm", help="list or remove the shared-memory segments")
    shm_sub = shm_p.add_subparsers(dest="shm_command", required=True)
    p = shm_sub.add_parser("list", help="segments with size, owner, model, plan, state", parents=[common])
    p.add_argument("--placement", action="store_true", help="pages per node of each live owner's mapping")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.set_defaults(func=cmd_shm_list)
    p = shm_sub.add_parser("clean", help="remove segments (only dead owners' unless --force)", parents=[common])
    p.add_argument("names", nargs="*", help="segment names (strata shm list shows them)")
    p.add_argument("--all", action="store_true",
                   help="every segment of a dead owner, and the pool folders (/tmp/strata-pool-*) of dead coordinators")
    p.add_argument("--force", action="store_true", help="remove segments of live owners too")
    p.set_defaults(func=cmd_shm_clean)


def _add_config_command(sub, common) -> None:
    """strata config's flags."""
    p = sub.add_parser("config", help="show the effective engine config and where each value came from",
                       parents=[common])
    add_engine_flags(p)
    p.set_defaults(func=cmd_config)


def _add_cache_command(sub, common) -> None:
    """strata cache's flags."""
    cache_p = sub.add_parser("cache", help="where the compiled CPU kernels are kept and what is compiled",
                             parents=[common])
    cache_p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    cache_p.set_defaults(func=cmd_cache)
    cache_sub = cache_p.add_subparsers(dest="cache_command")
    p = cache_sub.add_parser("clear", help="remove the compiled kernels (the next run compiles again)",
                             parents=[common])
    p.add_argument("--others", action="store_true",
                   help="only the other builds' folders (other sources, numba versions or CPUs), not this one's")
    p.set_defaults(func=cmd_cache_clear)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="strata", description="MoE decoding across NUMA nodes")
    parser.add_argument("-v", "--verbose", action="store_true", help="log at INFO level (also after the command)")
    parser.add_argument("-q", "--quiet", action="store_true", help="print no progress (also after the command)")
    parser.add_argument("--version", action="version", version=f"strata {_version()}")
    common = argparse.ArgumentParser(add_help=False)  # flags every command takes after its name too
    common.add_argument("-v", "--verbose", action="store_true", default=argparse.SUPPRESS,
                        help="log at INFO level")
    common.add_argument("-q", "--quiet", action="store_true", default=argparse.SUPPRESS,
                        help="print no progress (the kernels compiled on a first run, the pool's layout)")
    sub = parser.add_subparsers(dest="command", required=True)
    _add_make_model_command(sub, common)
    _add_generate_command(sub, common)
    add_chat_command(sub, common)  # strata chat: cli/chat.py
    _add_serve_command(sub, common)
    _add_client_command(sub, common)
    _add_bench_command(sub, common)
    _add_profile_command(sub, common)
    _add_topo_command(sub, common)
    _add_shm_command(sub, common)
    _add_config_command(sub, common)
    _add_cache_command(sub, common)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(levelname)s %(name)s: %(message)s")
    try:
        return args.func(args)
    except (StrataError, CheckpointError, ValueError) as exc:
        print(f"strata: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # Ctrl-C: end the line, no traceback, the shell's 128 + SIGINT
        print(file=sys.stderr)
        return 130
