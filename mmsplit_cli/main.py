"""`mmsplit` — run the services, talk to them, build the tiny model, run the demo.

mmsplit serve --model DIR [--tp N]          (both services: gRPC :50052, OpenAI API :8000)
mmsplit scheduler --model DIR --tp N --port P
mmsplit tokenizer --model DIR --scheduler HOST:PORT --port P
mmsplit generate --server HOST:PORT [--image FILE ...] [--video FILE ...] [--max-tokens N] [--json] "prompt"
mmsplit generate --server HOST:PORT [--system TEXT] --user TEXT [--assistant TEXT --user TEXT ...] [--image FILE]
mmsplit info|health --server HOST:PORT
mmsplit conformance --tokenizer HOST:PORT [--scheduler HOST:PORT]
mmsplit tiny-model DIR [--family llava|llava-next|qwen2-vl|qwen2.5-vl|qwen3-vl|qwen3-vl-moe|internvl|internvl3.5]
                      [--max-positions N]
mmsplit demo
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
from pathlib import Path
from typing import Any, NoReturn

from mmsplit_cli.config import add_settings_arguments, settings_from
from mmsplit_cli.tiny_model import FAMILIES
from mmsplit_server.serving import exit_now, raise_fd_limit, setup_logging, stop_with_parent
from mmsplit_server.settings import ServiceSettings


def _scheduler(args: argparse.Namespace) -> NoReturn:
    from scheduler_svc import group
    from scheduler_svc.settings import SchedulerSettings

    stop_with_parent()
    settings = settings_from(args, SchedulerSettings, "scheduler")
    # Before any heavy import or the weights: a wrong directory or a taken
    # port is one line now, not a traceback minutes from now. (Ranks other
    # than 0 of an env-launched group bind nothing.)
    ports = [(settings.host, settings.port, "--port")] if settings.launch == "local" else []
    group_size = (settings.tp, "--tp")
    if settings.launch == "env":
        from scheduler_svc.rendezvous import adopt_leaderworkerset_env, env_problem

        env = dict(os.environ)
        adopt_leaderworkerset_env(env)
        if problem := env_problem(env):
            print(f"mmsplit scheduler: {problem}", file=sys.stderr)
            raise SystemExit(2)
        group_size = (int(env["WORLD_SIZE"]), "WORLD_SIZE")
    _refuse_start("scheduler", settings.model_dir, [*ports, _metrics_port(settings)], group_size, weights=True)
    setup_logging(settings.log_level, settings.log_format)
    # Ranks 1..N-1 that must be spawned (CUDA) import torch and transformers
    # while this process does the same (below), instead of after: ~2.5 s
    # less to SERVING at TP=2. On CPU they are forks of this process once
    # its imports are done (`run`), and import nothing. Either way they
    # inherit the open-file limit.
    raise_fd_limit()
    ranks = group.start_early(settings)
    from scheduler_svc.server import run

    # Stopped in order: out without the interpreter's teardown, which every
    # stop (a rolling update, a pod moved) would wait out. An exception on
    # the way out never gets here: it ends the process with its traceback.
    exit_now(run(settings, ranks))


def _tokenizer(args: argparse.Namespace) -> NoReturn:
    from tokenizer_svc import forkserver
    from tokenizer_svc.settings import TokenizerSettings

    stop_with_parent()
    settings = settings_from(args, TokenizerSettings, "tokenizer")
    _refuse_start(
        "tokenizer",
        settings.model_dir,
        [
            (settings.host, settings.port, "--port"),
            (settings.host, settings.http_port, "--http-port"),
            _metrics_port(settings),
        ],
    )
    setup_logging(settings.log_level, settings.log_format)
    # The CPU pool's forkserver is a fork of this process once its imports
    # are done and before any thread starts: it imports nothing itself.
    # Its workers inherit the open-file limit it starts with.
    raise_fd_limit()
    from tokenizer_svc.server import run

    forkserver.start_forked()
    exit_now(run(settings))  # as the scheduler


def _metrics_port(settings: ServiceSettings) -> tuple[str, int, str]:
    return (settings.metrics_host or settings.host, settings.metrics_port, "--metrics-port")


def _refuse_start(
    service: str,
    model: Path,
    ports: list[tuple[str, int, str]],
    group: tuple[int, str] = (1, "--tp"),
    *,
    weights: bool = False,
) -> None:
    from mmsplit_cli.startup import first_problem

    problem = first_problem(model, ports, group, weights=weights)
    if problem:
        print(f"mmsplit {service}: {problem}", file=sys.stderr)
        raise SystemExit(2)


def _bias(text: str) -> tuple[int, float]:
    """ID=BIAS, for --logit-bias."""
    token, _, bias = text.partition("=")
    try:
        return _count(token), float(bias)
    except (ValueError, argparse.ArgumentTypeError):
        raise argparse.ArgumentTypeError(f"{text!r} is not ID=BIAS (a token id, a number)") from None


def _count(text: str) -> int:
    """A whole number, 0 or more (argparse says which flag otherwise)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"{value} is negative")
    return value


class _Turn(argparse.Action):
    """Collects (role, text) of --system/--user/--assistant in the order given."""

    def __call__(
        self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any, option: Any = None
    ) -> None:
        turns = [*getattr(namespace, self.dest, []), (str(option).lstrip("-"), values)]
        setattr(namespace, self.dest, turns)


def _generate(args: argparse.Namespace) -> int:
    from mmsplit_cli.client import generate_command

    if bool(args.prompt) == bool(args.turns):
        print("mmsplit generate: give a prompt or a conversation (--user, ...), one of the two", file=sys.stderr)
        return 2
    return generate_command(args)


def _conformance(args: argparse.Namespace) -> int:
    from mmsplit.conformance import run_command

    return run_command(args)


def _tiny_model(args: argparse.Namespace) -> int:
    import shutil

    from mmsplit_cli.tiny_model import MARKER, build

    ours = args.dir.is_dir() and (args.dir / MARKER).is_file()  # a tiny model written before: written again
    if not ours and args.dir.exists() and (not args.dir.is_dir() or any(args.dir.iterdir())):
        held = "is a file" if not args.dir.is_dir() else "is not empty"
        print(
            f"mmsplit tiny-model: {args.dir} {held}: give a new or empty directory, or one this command wrote (the "
            "tiny model's config, weights and tokenizer would overwrite what is there, a real checkpoint's included)",
            file=sys.stderr,
        )
        return 2
    setup_logging("INFO")
    # Written beside it, then renamed: a build stopped half way (Ctrl-C)
    # leaves DIR as it was, and no directory the next run would refuse.
    building = args.dir.parent / f".{args.dir.name}.building-{os.getpid()}"
    try:
        build(
            building,
            cache_dir=args.cache_dir,
            family=args.family,
            text_layers=args.text_layers,
            text_hidden=args.text_hidden,
            max_positions=args.max_positions,
            chat_template=args.chat_template,
            named=args.dir,
        )
        if ours:
            shutil.rmtree(args.dir)  # none of the earlier model's files left over
        elif args.dir.is_dir():
            args.dir.rmdir()  # empty
        building.rename(args.dir)
    finally:
        shutil.rmtree(building, ignore_errors=True)
    return 0


def _info(args: argparse.Namespace) -> int:
    from mmsplit_cli.client import info_command

    return info_command(args)


def _health(args: argparse.Namespace) -> int:
    from mmsplit_cli.client import health_command

    return health_command(args)


def _serve(args: argparse.Namespace) -> int:
    from mmsplit_cli.serve import serve_command

    return serve_command(args)


def _demo(args: argparse.Namespace) -> int:
    from mmsplit_cli.demo import run_demo

    return run_demo(workdir=args.workdir, tp=args.tp, cache_dir=args.cache_dir)


def parser() -> argparse.ArgumentParser:
    from scheduler_svc.settings import SchedulerSettings
    from tokenizer_svc.settings import TokenizerSettings

    top = argparse.ArgumentParser(
        prog="mmsplit", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    from mmsplit import __version__

    top.add_argument("--version", action="version", version=f"mmsplit {__version__}")
    sub = top.add_subparsers(dest="command", required=True)

    from mmsplit_cli.serve import add_arguments as add_serve_arguments

    p = sub.add_parser(
        "serve", help="a scheduler group and a tokenizer on this machine: gRPC on 50052, the OpenAI API on 8000"
    )
    add_serve_arguments(p)
    p.set_defaults(func=_serve)

    p = sub.add_parser("scheduler", help="run the tensor-parallel scheduler group (rank 0 serves gRPC)")
    add_settings_arguments(p, SchedulerSettings, "scheduler")
    p.set_defaults(func=_scheduler)

    p = sub.add_parser("tokenizer", help="run the client-facing tokenizer service")
    add_settings_arguments(p, TokenizerSettings, "tokenizer")
    p.set_defaults(func=_tokenizer)

    p = sub.add_parser("generate", help="send one request to a tokenizer service and print the stream")
    p.add_argument("--server", default="127.0.0.1:50052", help="tokenizer address HOST:PORT")
    p.add_argument(
        "--image", action="append", default=[], help="image file (sent as inline bytes) or URL (http(s):, data:)"
    )
    p.add_argument("--video", action="append", default=[], help="video file or URL, as --image (Qwen-VL models)")
    for bound in ("max", "min"):
        p.add_argument(
            f"--{bound}-pixels",
            type=_count,
            default=0,
            help=f"Qwen-VL models: the {bound}imum pixels each image is resized to, within the checkpoint's budget "
            "(GetServerInfo's image_min_pixels, image_max_pixels); 0 = the checkpoint's",
        )
    p.add_argument(
        "--video-fps",
        type=float,
        default=0.0,
        help="Qwen-VL models: frames sampled per second of video; 0 = the server's",
    )
    p.add_argument(
        "--video-max-frames",
        type=_count,
        default=0,
        help="Qwen-VL models: at most this many frames of each video (up to the server's); 0 = the server's",
    )
    p.add_argument(
        "--truncate-prompt-tokens",
        type=int,
        default=0,
        metavar="N",
        help="the model reads only the prompt's last N tokens (-1: as many as the context holds); 0 = all",
    )
    p.add_argument("--max-tokens", type=_count, default=0, help="0 = the server's default")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy, else within [0.001, 100]")
    p.add_argument("--seed", type=_count, default=0, help="0 = derived from the request id")
    p.add_argument("--top-p", type=float, default=None, help="nucleus sampling, within (0, 1]; default off")
    p.add_argument("--top-k", type=_count, default=0, help="0 = off")
    p.add_argument(
        "--min-p", type=float, default=0.0, help="keep tokens at least this times as likely as the likeliest; 0 = off"
    )
    p.add_argument("--ignore-eos", action="store_true", help="run to --max-tokens: end-of-sequence does not end it")
    p.add_argument("--min-tokens", type=_count, default=0, help="no end-of-sequence or stop token before this many")
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument("--stop-token-id", action="append", default=[], type=_count, help="stop token id (repeatable)")
    p.add_argument("--presence-penalty", type=float, default=0.0, help="OpenAI's, within [-2, 2]; 0 = off")
    p.add_argument("--frequency-penalty", type=float, default=0.0, help="OpenAI's, within [-2, 2]; 0 = off")
    p.add_argument("--repetition-penalty", type=float, default=1.0, help="transformers', within (0, 2]; 1 = off")
    p.add_argument(
        "--logit-bias",
        action="append",
        default=[],
        type=_bias,
        metavar="ID=BIAS",
        help="add BIAS (within [-100, 100]) to token ID's logit (repeatable)",
    )
    p.add_argument(
        "--allowed-token-id",
        action="append",
        default=[],
        type=_count,
        help="only these tokens may be generated (repeatable)",
    )
    p.add_argument("--bad-word", action="append", default=[], help="a word never generated (repeatable)")
    p.add_argument(
        "--n",
        type=_count,
        default=1,
        metavar="N",
        help="N independent choices (at most 8): prints each, in order",
    )
    p.add_argument(
        "--beams",
        type=_count,
        default=0,
        metavar="N",
        help="beam search of N beams (at most 8) instead of sampling: prints each, best first",
    )
    p.add_argument(
        "--length-penalty",
        type=float,
        default=None,
        help="beam search: a beam's summed log probability is divided by its length to this power (default 1)",
    )
    p.add_argument(
        "--priority",
        type=int,
        default=0,
        help="lower is admitted first, where the scheduler runs --scheduling-policy priority",
    )
    p.add_argument(
        "--json-schema",
        default="",
        metavar="SCHEMA",
        help="structured output: a JSON Schema (JSON text, or @FILE) the answer must match",
    )
    p.add_argument("--regex", default="", help="structured output: a regular expression the whole answer must match")
    p.add_argument(
        "--choice",
        action="append",
        default=[],
        metavar="TEXT",
        help="structured output: the answer is exactly one of these (repeatable)",
    )
    p.add_argument(
        "--grammar",
        default="",
        help="structured output: a grammar (Lark or GBNF text, or @FILE) the whole answer must match",
    )
    p.add_argument(
        "--prompt-logprobs",
        type=_count,
        default=None,
        metavar="N",
        help="also score the prompt: each token's log probability, rank and N (0-20) top tokens (--json prints them)",
    )
    p.add_argument(
        "--tokenize",
        action="store_true",
        help="count the prompt's tokens (the Tokenize RPC: media included) instead of generating",
    )
    p.add_argument("--request-id", default="")
    p.add_argument("--timeout", type=float, default=120.0, help="deadline of the call, seconds")
    p.add_argument(
        "--retries", type=int, default=3, help="retries of a retriable failure before any output (gRPC's policy)"
    )
    for role in ("system", "user", "assistant"):
        p.add_argument(
            f"--{role}",
            dest="turns",
            action=_Turn,
            default=[],
            metavar="TEXT",
            help=f"a {role} turn of a conversation (turns go in the order given; instead of a prompt)",
        )
    p.add_argument("--json", action="store_true", help="print one JSON object per event")
    p.add_argument("--tls-ca", default="", help="PEM CA certificates: connect with TLS, trusting them")
    p.add_argument("--tls-cert", default="", help="PEM client certificate, when the server requires one")
    p.add_argument("--tls-key", default="", help="PEM private key of --tls-cert")
    p.add_argument("--tls-server-name", default="", help="name the server's certificate carries, if not --server's")
    p.add_argument("prompt", nargs="?", help="the prompt (or a conversation: --system, --user, --assistant)")
    p.set_defaults(func=_generate)

    for name, func, what in (
        ("info", _info, "print a server's GetServerInfo as JSON"),
        ("health", _health, "print a server's health (live, ready); exit 0 only when both"),
    ):
        p = sub.add_parser(name, help=what)
        p.add_argument("--server", default="127.0.0.1:50052", help="address HOST:PORT (a tokenizer or a scheduler)")
        p.add_argument("--timeout", type=float, default=10.0, help="deadline of each call, seconds")
        p.set_defaults(func=func)

    p = sub.add_parser(
        "conformance", help="check a server against the contract's promises; a table, non-zero on failure"
    )
    from mmsplit.conformance import add_arguments

    add_arguments(p)
    p.set_defaults(func=_conformance)

    cache_help = "where the tokenizer's source wheel is cached"
    p = sub.add_parser("tiny-model", help="write a tiny random-weight multimodal model with a real tokenizer")
    p.add_argument("dir", type=Path)
    p.add_argument("--family", choices=FAMILIES, default="llava", help="the model family (default: llava)")
    p.add_argument("--cache-dir", type=Path, default=Path(".cache"), help=cache_help)
    p.add_argument("--text-layers", type=int, default=2, help="layers of the text model")
    p.add_argument("--text-hidden", type=int, default=64, help="hidden size of the text model")
    p.add_argument("--max-positions", type=int, default=1024, help="the text model's context (max_position_embeddings)")
    p.add_argument(
        "--no-chat-template",
        dest="chat_template",
        action="store_false",
        help="LLaVA families: write no chat template (prompts are then used as written; conversations are refused)",
    )
    p.set_defaults(func=_tiny_model)

    p = sub.add_parser("demo", help="both services, a tiny model, scripted requests, a table of outcomes")
    p.add_argument("--workdir", type=Path, default=None, help="default: a temporary directory")
    p.add_argument("--tp", type=int, default=2)
    p.add_argument("--cache-dir", type=Path, default=Path(".cache"), help=cache_help)
    p.set_defaults(func=_demo)
    return top


# How long an OpenMP thread spins for the next parallel region before it
# sleeps (libgomp's units, ~0.2 ms here). OpenMP's own default spins 3 ms,
# which starves the gRPC threads and the service next to it (one request at
# a time was up to 3x slower); sleeping at once (OMP_WAIT_POLICY=PASSIVE)
# makes every operator of a forward wake its threads through the kernel.
# bench/RESULTS.md, bench/engine.py: 8x512 one at a time +65 %, 32 at once
# +10 %; the tiny model 32 at once -10 % (its streaming wanted that core).
SPIN_COUNT = "20000"


def openmp_defaults(env: dict[str, str] | os._Environ[str]) -> None:
    """Before torch is imported (OpenMP reads these once); what the
    environment sets wins."""
    if "OMP_WAIT_POLICY" not in env and "GOMP_SPINCOUNT" not in env:
        env["GOMP_SPINCOUNT"] = SPIN_COUNT


def main(argv: list[str] | None = None) -> None:
    openmp_defaults(os.environ)
    args = parser().parse_args(argv)
    try:
        sys.exit(args.func(args))
    except KeyboardInterrupt:
        # Ctrl-C in a client command (the services stop on it by themselves):
        # what was asked is cancelled as the call closes, and nothing more is
        # said than a shell's usual exit status.
        print(file=sys.stderr)
        sys.exit(128 + signal.SIGINT)


if __name__ == "__main__":
    main()
