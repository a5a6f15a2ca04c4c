"""The ``whet`` command line: serve, learn, adapters, tools, doctor, turns, forget, chat, bench.

Config problems end with one line naming the key and the fix, exit code 2.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from whet.config.settings import ConfigError, WhetConfig, load_config

EXIT_CONFIG = 2


def main(argv: Sequence[str] | None = None) -> int:
    parser = _parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:2] == ["bench", "perf"]:  # every option after it is bench/perf.py's own (its --help too)
        args = argparse.Namespace(command="bench", bench="perf", options=argv[2:], run=_bench_perf)
    else:
        args = parser.parse_args(argv)
    if not getattr(args, "command", None):
        parser.print_help()
        return EXIT_CONFIG
    try:
        return args.run(args)
    except ConfigError as exc:
        print(f"whet: {exc}", file=sys.stderr)
        return EXIT_CONFIG
    except KeyboardInterrupt:
        return 130


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="whet", description="A self-hosted agent service that gets better by being used.")
    sub = parser.add_subparsers(dest="command")

    serve = sub.add_parser("serve", help="run the service (OpenAI-compatible API, MCP tools, learning)")
    _config_arg(serve)
    serve.add_argument("--model", help="HF model id or local model folder (default: model.id, smollm2)")
    serve.add_argument("--host", help="bind address (default 127.0.0.1)")
    serve.add_argument("--port", type=int, help="port (default 8000)")
    serve.add_argument("--no-learner", action="store_true",
                       help="serve only; run `whet learn` elsewhere (same store and bus) to learn")  # fmt: skip
    serve.set_defaults(run=_serve)

    learn = sub.add_parser("learn", help="run the learner on its own: judge, keep lessons, train and publish adapters")
    _config_arg(learn)
    learn.add_argument("--once", action="store_true", help="judge and train what is waiting, then exit")
    learn.set_defaults(run=_learn)

    adapters = sub.add_parser("adapters", help="list, inspect, promote or roll back adapter versions")
    adapters_sub = adapters.add_subparsers(dest="action", required=True)
    listing = adapters_sub.add_parser("list", help="every version with its status and gate result")
    listing.add_argument("--json", action="store_true", help="print JSON instead of a table")
    show = adapters_sub.add_parser("show", help="one version in full (metrics, gate, the turns it trained on)")
    show.add_argument("version")
    promote = adapters_sub.add_parser("promote", help="make a version live now (skips the gate)")
    promote.add_argument("version")
    rollback = adapters_sub.add_parser("rollback", help="retire the live version and bring back its parent")
    rollback.add_argument("--user", help="whose adapter, when learner.scope is user")
    for parser_ in (listing, show, promote, rollback):
        _config_arg(parser_)
    adapters.set_defaults(run=_adapters)

    tools = sub.add_parser("tools", help="start the configured MCP servers and list their tools")
    _config_arg(tools)
    tools.add_argument("--json", action="store_true", help="print JSON instead of a table")
    tools.set_defaults(run=_tools)

    doctor = sub.add_parser("doctor", help="check the config, MCP servers, store, bus, model and data directory; "
                            "exit 0 only if all pass")  # fmt: skip
    _config_arg(doctor)
    doctor.add_argument("--json", action="store_true", help="print JSON instead of a table")
    doctor.set_defaults(run=_doctor)

    turns = sub.add_parser("turns", help="show recorded turns from the experience store")
    _config_arg(turns)
    turns.add_argument("--session", help="only this session")
    turns.add_argument("--user", help="only this user")
    turns.add_argument("--limit", type=int, default=20)
    turns.add_argument("--follow", "-f", action="store_true", help="keep printing new turns as they are recorded")
    turns.set_defaults(run=_turns)

    forget = sub.add_parser("forget", help="delete everything of a user: turns, feedback, verdicts, sessions, "
                            "lessons, notes (through the tool servers) and per-user adapter files")  # fmt: skip
    _config_arg(forget)
    forget.add_argument("user", help="the user id")
    forget.set_defaults(run=_forget)

    chat = sub.add_parser("chat", help="chat in the terminal with a running whet server")
    chat.add_argument("--url", default="http://127.0.0.1:8000", help="server base URL")
    chat.add_argument("--api-key", help="bearer API key, when the server has keys configured")
    chat.add_argument("--model", help="model name (default: the server's first model)")
    chat.set_defaults(run=_chat)

    model = sub.add_parser("model", help="the default model (model.id smollm2), built here")
    model_sub = model.add_subparsers(dest="action", required=True)
    build = model_sub.add_parser("build", help="build the default model (what model.id smollm2 serves; "
                                 "whet serve builds it on first start anyway)")  # fmt: skip
    _config_arg(build)
    build.add_argument("--out", type=Path, help="model folder (default: <data_dir>/models/smollm2)")
    build.add_argument("--seed", type=int, default=0)
    build.add_argument("--force", action="store_true", help="rebuild even if the folder holds a model")
    build.set_defaults(run=_model_build)

    bench = sub.add_parser("bench", help="measure whet")
    bench_sub = bench.add_subparsers(dest="bench", required=True)
    learning = bench_sub.add_parser("learn", help="held-out success while a simulated user teaches a live server, "
                                    "for static / memory / lora / memory_lora from the same start")  # fmt: skip
    _config_arg(learning)
    learning.add_argument("--profile", type=Path, help="simulated user profile (default: the shipped one)")
    learning.add_argument("--seed", type=int, default=0)
    learning.add_argument("--interactions", type=_positive, help="interactions per arm (default 32)")
    learning.add_argument("--every", type=_positive, help="measure held-out success every K interactions (default 8)")
    learning.add_argument("--heldout", type=_positive, help="held-out personal tasks per measurement (default 24)")
    learning.add_argument("--general", type=_positive, help="general tasks, before and after (default 16)")
    learning.add_argument("--chat", type=_positive, help="chat-probe requests (no tool needed), before and after (default 12)")
    learning.add_argument("--lora-lr", type=float, help="the learner's LoRA learning rate in the arms (default 2e-3)")
    learning.add_argument("--model", help="HF model id or local folder (default: the config's model.id)")
    learning.add_argument("--arms", type=_arms, default="static,memory,lora,memory_lora",
                          help="comma-separated subset of static,memory,lora,memory_lora")  # fmt: skip
    learning.add_argument("--json", dest="json_path", type=Path, default=Path("bench-learn.json"), help="results file")
    learning.add_argument("--plot", type=Path, default=Path("bench-learn.png"), help="learning curves (PNG)")
    learning.add_argument("--quick", action="store_true", help="CI scale: 4 interactions, every 2, 3 held-out, 3 general, 2 chat")
    learning.add_argument("--keep", action="store_true", help="keep each arm's data directory (store, adapters, log)")
    learning.add_argument("--jobs", type=_positive, help="arms run at once, each pinned to its share of the CPU cores "
                          "(default: one per core, at most one per arm)")  # fmt: skip
    learning.add_argument("--idle-timeout", type=_positive, metavar="SECONDS",
                          help="longest a checkpoint waits on a busy learner that shows no progress (no new verdict, "
                          "lesson or training step; default 900)")  # fmt: skip
    learning.set_defaults(run=_bench_learn)
    perf = bench_sub.add_parser("perf", help="every performance figure (bench/perf.py: serving, swaps, lessons, "
                                "adapters, store, bus, training); its own options follow, see --help there",
                                add_help=False)  # fmt: skip
    perf.set_defaults(run=_bench_perf)  # main() hands everything after `bench perf` to the script
    return parser


def _config_arg(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", type=Path, help="a YAML file overriding config/whet.yaml")


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, not {value}")
    return value


def _arms(text: str) -> tuple[str, ...]:
    from whet.world.bench import ARMS

    arms = tuple(dict.fromkeys(a.strip() for a in text.split(",") if a.strip()))
    unknown = [a for a in arms if a not in ARMS]
    if unknown or not arms:
        raise argparse.ArgumentTypeError(f"unknown arm {', '.join(unknown) or '(none)'}; use some of {','.join(ARMS)}")
    return arms


def _load(args: argparse.Namespace, overrides: dict[str, Any] | None = None) -> WhetConfig:
    from whet.runtime.logs import configure_logging

    config = load_config(args.config, overrides)
    configure_logging(config.log)
    return config


def _serve(args: argparse.Namespace) -> int:
    import structlog
    import uvicorn

    from whet.runtime.app import create_app
    from whet.runtime.policy import BackendError
    from whet.runtime.state import configured_tool_pool

    overrides: dict[str, Any] = {"server": {}, "model": {}, "learner": {}}
    if args.no_learner:
        overrides["learner"]["enabled"] = False
    if args.model:
        overrides["model"]["id"] = args.model
    if args.host:
        overrides["server"]["host"] = args.host
    if args.port is not None:
        overrides["server"]["port"] = args.port
    config = _load(args, overrides)
    structlog.get_logger().info("config", **config.redacted())
    tools = configured_tool_pool(config)  # a bad mcpServers file stops here, not inside the server
    if config.learner.enabled:
        from whet.learner.learner import check_config

        check_config(config, standalone=False)
    try:  # the port first: taken, it is one line now, not a uvicorn error after the model loaded and "whet ready"
        sock = _listen(config.server.host, config.server.port)
    except OSError as exc:
        print(f"whet: cannot listen on {config.server.host}:{config.server.port}: {exc.strerror or exc}\n"
              "  fix: stop what holds that port (another whet serve?), or pass --port N (server.port)", file=sys.stderr)  # fmt: skip
        return 1
    try:
        backend = _load_backend(config)
    except BackendError as exc:
        print(f"whet: cannot load the model: {exc}", file=sys.stderr)
        sock.close()
        return 1
    app = create_app(config, backend=backend, tools=tools)
    url = f"http://{config.server.host}:{config.server.port}"
    structlog.get_logger().info("serving", url=url, openai_base_url=f"{url}/v1", model=config.model.name)
    uvicorn.Server(uvicorn.Config(app, log_config=None, access_log=False)).run(sockets=[sock])
    return 0


def _listen(host: str, port: int) -> socket.socket:
    """A listening TCP socket on ``host:port`` (bound as uvicorn would bind it), or OSError."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(2048)
        sock.set_inheritable(True)
    except OSError:
        sock.close()
        raise
    return sock


def _load_backend(config: WhetConfig):
    from rich.console import Console

    from whet.runtime.backends import create_backend

    if config.model.id == "smollm2" and config.model.backend != "openai":  # the default model
        from whet.learner.model import DEFAULT_MODEL, ModelLoadError, model_dir
        from whet.runtime.policy import BackendError

        try:
            ensure_default_model(model_dir(config.data_path, DEFAULT_MODEL))
        except ModelLoadError as exc:
            raise BackendError(str(exc)) from None
    with Console(stderr=True).status(f"loading {config.model.id} ({config.model.backend})"):
        return create_backend(config.model, config.data_path)


# what the default model's build reports, by stage
BUILD_STAGES = {
    "convert": "converting the base model",
    "distill": "distilling",
    "data": "writing conversations",
    "train": "training",
}


def ensure_default_model(out_dir: Path, *, seed: int = 0, force: bool = False) -> Path:
    """The default model in ``out_dir``, built there first (with progress bars) if it is not built yet."""
    import shutil

    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from whet.world.warmstart import build_default_model

    if force:
        shutil.rmtree(out_dir, ignore_errors=True)
    if (out_dir / "config.json").is_file():
        return out_dir
    console = Console(stderr=True)
    console.print(f"building the default model into {out_dir} (first start only)")
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
               TextColumn("{task.fields[info]}"))  # fmt: skip
    with Progress(*columns, console=console) as progress:
        bars: dict[str, Any] = {}

        def report(stage: str, done: int, total: int, info: dict) -> None:
            if stage not in bars:
                bars[stage] = progress.add_task(BUILD_STAGES.get(stage, stage), total=total, info="")
            text = f"loss {info['loss']:.3f}" if "loss" in info else ""
            progress.update(bars[stage], completed=done, info=text)

        return build_default_model(out_dir, seed=seed, progress=report)


def _model_build(args: argparse.Namespace) -> int:
    from whet.learner.model import DEFAULT_MODEL, model_dir

    config = _load(args)
    out = args.out.expanduser() if args.out else model_dir(config.data_path, DEFAULT_MODEL)
    if (out / "config.json").is_file() and not args.force:
        print(f"whet: {out} already holds a model; pass --force to rebuild it", file=sys.stderr)
        return 1
    if out.exists() and not (out / "config.json").is_file() and any(out.iterdir()):
        print(f"whet: {out} exists and is not a model folder; choose another --out", file=sys.stderr)
        return 1
    started = time.perf_counter()
    ensure_default_model(out, seed=args.seed, force=args.force)
    print(f"built {out} in {time.perf_counter() - started:.0f}s; serve it with `whet serve --model {out}`"
          + ("" if args.out else f" or model.id: {DEFAULT_MODEL}"))
    return 0


def _learn(args: argparse.Namespace) -> int:
    from whet.learner.cli import learn

    return learn(_load(args), once=args.once)


def _adapters(args: argparse.Namespace) -> int:
    from whet.learner.cli import adapters

    config = _load(args)
    return adapters(config, args.action, getattr(args, "version", None), getattr(args, "user", None),
                    getattr(args, "json", False))  # fmt: skip


def _tools(args: argparse.Namespace) -> int:
    import anyio

    from whet.runtime.state import configured_tool_pool

    config = _load(args)
    pool = configured_tool_pool(config)

    async def listing() -> tuple[list[Any], dict[str, str], dict[str, str]]:
        async with pool:
            return pool.tools(), pool.status(), pool.errors()

    tools, status, errors = anyio.run(listing)
    if args.json:
        servers = {name: {"status": state, "error": errors.get(name)} for name, state in status.items()}
        listed = [{"name": t.name, "server": t.server, "description": t.description} for t in tools]
        print(json.dumps({"servers": servers, "tools": listed}, indent=2))
        return 1 if errors else 0
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"{len(tools)} tools from {len(status)} servers")
    for column in ("tool", "server", "description"):
        table.add_column(column)
    for t in tools:
        table.add_row(t.name, t.server, t.description.splitlines()[0] if t.description else "")
    console = Console()
    console.print(table)
    for server, why in errors.items():
        console.print(f"[red]server {server}: {status[server]}: {why}[/red] (`whet doctor` says how to fix it)")
    return 1 if errors else 0


def _doctor(args: argparse.Namespace) -> int:
    import anyio

    from whet.config.settings import LogConfig
    from whet.runtime.doctor import print_report, run_checks
    from whet.runtime.logs import configure_logging

    configure_logging(LogConfig(level="error"))  # the report says what failed; log lines would bury it
    checks = anyio.run(run_checks, args.config)
    if args.json:
        print(json.dumps([check.public() for check in checks], indent=2))
    else:
        print_report(checks)
    code = 0 if all(check.ok for check in checks) else 1
    if any(check.name.startswith("mcp server") and not check.ok for check in checks):
        # a server that never answered leaves its start attempt blocked in a worker thread, and the
        # interpreter's shutdown can abort on it (SIGABRT, exit -6, seen under load): the report is
        # out, so leave without that shutdown
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    return code


def _turns(args: argparse.Namespace) -> int:
    import anyio

    from whet.memory.store import open_store

    config = _load(args)

    async def show() -> None:
        store = open_store(config.store_url, config.store.sqlite_sync)
        try:
            turns = await store.list_turns(session_id=args.session, user_id=args.user, limit=args.limit)
            for turn in reversed(turns):
                _print_turn(turn)
            since = turns[0].created_at if turns else None
            while args.follow:
                await anyio.sleep(1.0)  # polling the store: it is the source of truth, shared by every replica
                fresh = await store.list_turns(session_id=args.session, user_id=args.user, limit=500, since=since)
                for turn in reversed(fresh):
                    _print_turn(turn)
                since = fresh[0].created_at if fresh else since
        finally:
            await store.aclose()

    anyio.run(show)
    return 0


def _forget(args: argparse.Namespace) -> int:
    import anyio

    from whet.memory.bus import open_bus
    from whet.memory.store import open_store
    from whet.runtime.forget import forget_user
    from whet.runtime.state import configured_tool_pool

    config = _load(args)
    pool = configured_tool_pool(config)

    async def run() -> Any:
        store = open_store(config.store_url, config.store.sqlite_sync)
        bus = open_bus(config.bus.url, config.bus.client_id)
        await bus.start()
        try:
            async with pool:
                return await forget_user(args.user, store=store, bus=bus, tools=pool,
                                         adapters_root=config.data_path / "adapters")  # fmt: skip
        finally:
            await bus.aclose()
            await store.aclose()

    report = anyio.run(run)
    rows = ", ".join(f"{n} {table}" for table, n in report.store.items() if n)
    print(f"forgot user {args.user}: {rows or 'no rows'} from the store; {len(report.adapter_files)} adapter folders; "
          f"tool servers: {', '.join(report.tools) or 'none that keep user data'}")  # fmt: skip
    if config.bus.url is None:
        print("note: with the in-process bus a running `whet serve` keeps this user's lessons in memory until it "
              "restarts; forget through DELETE /v1/users/<id> on it instead", file=sys.stderr)  # fmt: skip
    for server, why in report.failed.items():
        print(f"whet: server {server} could not forget {args.user}: {why}; run `whet forget` again", file=sys.stderr)
    return 0 if report.complete else 1


def _print_turn(turn: Any) -> None:
    calls = ", ".join(c["function"]["name"] for c in turn.tool_calls) or "-"
    state = turn.next_state_kind or "open"
    text = turn.response_text.replace("\n", " ")[:100]
    stamp = turn.created_at.strftime("%Y-%m-%d %H:%M:%S")
    print(f"{stamp}  {turn.id}  {turn.user_id}  v={turn.policy_version or 'base'}  tools={calls}  [{state}]  {text}")


def _bench_learn(args: argparse.Namespace) -> int:
    from whet.world.bench import BenchError, Plan, run_bench

    config = _load(args)
    try:
        return run_bench(config, Plan.from_args(args, config), prepare_model=ensure_default_model,
                         whet=[sys.executable, "-m", "whet.runtime.cli"])  # fmt: skip
    except BenchError as exc:
        print(f"whet: {exc}", file=sys.stderr)
        return 1


def _bench_perf(args: argparse.Namespace) -> int:
    """bench/perf.py from the source checkout whet runs from (the benchmarks are not part of a wheel)."""
    script = Path(__file__).resolve().parent.parent / "bench" / "perf.py"
    if not script.is_file():
        print("whet: `whet bench perf` runs bench/perf.py from a source checkout of whet, and this install has "
              "none; clone the repository and run `python bench/perf.py` there", file=sys.stderr)  # fmt: skip
        return 2
    return subprocess.call([sys.executable, str(script), *args.options])


def _chat(args: argparse.Namespace) -> int:
    from whet.runtime.console import run_chat

    return run_chat(args.url, args.api_key, args.model)


if __name__ == "__main__":
    sys.exit(main())
