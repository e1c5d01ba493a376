"""Serving speed: `rlfleet serve` against llama.cpp's server on the same GGUF, side by side in one run.

Both servers run on this machine at once, with the same threads, and answer the same requests: a
fixed list of short chat prompts (with the model's own default system prompt written out, so both
build the same ChatML prompt), the chat's sampling (temperature and top-p from ``[chat]``'s defaults,
nothing else: llama.cpp is sent ``top_k 0``, ``min_p 0``, ``repeat_penalty 1``, its no-op values, in
place of its server's defaults 40, 0.05 and 1.1), the same ``max_tokens`` and the same seed for the
same request. The draws still differ: llama-cpp-python applies top-p before the temperature
(transformers after), and the two stacks' random numbers differ, so answers differ in length; the
table gives completion tokens per answer beside the speeds. rlfleet loads the GGUF into torch
(dequantised to fp32) and returns the answer's log-probs with it; llama.cpp computes on the quantised
file itself.

* ``rlfleet``: ``rlfleet serve`` from this venv (``sys.executable -m rlfleet.cli serve``), an empty
  RLFLEET_HOME but for ``chat.engine = --engine`` (default ``auto``: llama.cpp draws the tokens where
  this venv has llama-cpp-python, ``torch`` as before it; the JSON's ``rlfleet_engine`` says which
  answered), ``OMP_NUM_THREADS`` = ``--threads``.
* ``llamacpp``: ``PYTHON -m llama_cpp.server --model GGUF --n_threads T --n_threads_batch T`` from
  llama-cpp-python's own venv (``--llamacpp-python``).

Figures per server, each the median over ``--rounds``: single-stream tokens/s (the prompts one after
another, not streamed: completion tokens summed from each reply's ``usage.completion_tokens``, over
the wall time of the whole pass); time to first token (the prompts again, streamed, asking
``stream_options.include_usage``, which llama-cpp-python 0.3.36 ignores: the median time from sending
to the first chunk that carries content); answers/s with 1, 4 and 16 concurrent clients (each
client sends ``--per-client`` requests back to back, not streamed, since llama-cpp-python's server
cuts a stream short when another request arrives; answers over the wall time from the first send to
the last reply). Every phase runs on one server and then on the other, the order swapped every
round, so the machine's noise hits both; each server answers one warm-up request first, not
counted. rlfleet counts an answer's end token in ``completion_tokens`` (it is part of the behaviour
policy it returns), llama.cpp does not.

On a CPU that advertises units it refuses (AMX tiles under some hypervisors), llama.cpp's repacked
weights die on the first token; ``--llamacpp-repack auto`` (the default) asks rlfleet's probe and
starts the server without repacking there, as rlfleet's own engine then runs.

Building llama.cpp's venv (llama-cpp-python 0.3.36 compiles llama.cpp from its sdist with cmake and
gcc; one job, since the machine's cores are shared; pins in bench/llamacpp-requirements.txt; where
this venv has the ``[fast]`` extra, ``pip install`` of the wheel pip built for it, from pip's cache,
with the ``[server]`` extra takes seconds):

    python3 -m venv /work/llamacpp-venv
    CMAKE_BUILD_PARALLEL_LEVEL=1 MAKEFLAGS=-j1 /work/llamacpp-venv/bin/pip install \\
        -r bench/llamacpp-requirements.txt

Runs:

    python -m bench.serve --threads 1 --rounds 2            # the default model, both servers
    python -m bench.serve --servers rlfleet --model DIR     # ours alone (any model folder)
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path

from .record import markdown_table, output_options, parser, publish, stop_processes

SERVERS = ("rlfleet", "llamacpp")
NAMES = {"rlfleet": "rlfleet serve", "llamacpp": "llama.cpp"}
LLAMACPP_PYTHON = "/work/llamacpp-venv/bin/python"
CLIENTS = (1, 4, 16)
# SmolLM2's chat template puts this in when a conversation has no system message; written out here so
# that both servers build the same prompt whatever their template handling does.
SYSTEM = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"
PROMPTS = (
    "What is the capital of France?",
    "Give me three tips for sleeping better.",
    "Explain what a hash table is in two sentences.",
    "Write a haiku about autumn rain.",
    "How do I reverse a list in Python?",
    "Why is the sky blue?",
    "Suggest a name for a small coffee shop.",
    "What is the difference between weather and climate?",
    "Translate 'good morning' into Spanish and German.",
    "Summarise the plot of Romeo and Juliet in one sentence.",
    "What should I pack for a weekend hike?",
    "Tell me a short joke about computers.",
    "How many minutes are there in a day?",
    "What does HTTP stand for?",
    "Give me a simple recipe for pancakes.",
    "What is photosynthesis?",
)


# -- the servers -----------------------------------------------------------------------------------


@dataclass
class Server:
    name: str
    proc: subprocess.Popen
    port: int
    log: Path
    load_s: float = 0.0
    model: str = ""

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    def tail(self, lines: int = 25) -> str:
        try:
            text = self.log.read_text(errors="replace")
        except OSError:
            return "(no log)"
        return "\n".join(text.strip().splitlines()[-lines:]) or "(empty log)"

    def fail(self, what: str) -> SystemExit:
        return SystemExit(f"{NAMES[self.name]} {what}; the end of its log:\n{self.tail()}")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(name: str, cmd: list[str], env: dict[str, str], workdir: Path, timeout: float) -> Server:
    """Start one server, its output to a log file, and wait until ``/v1/models`` answers."""
    log = workdir / f"{name}.log"
    port = int(cmd[cmd.index("--port") + 1])
    t0 = time.perf_counter()
    with log.open("w") as out:
        proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    server = Server(name, proc, port, log)
    deadline = time.monotonic() + timeout
    while True:
        try:
            with urllib.request.urlopen(f"{server.url}/models", timeout=5) as resp:
                server.model = json.load(resp)["data"][0]["id"]
            break
        except (urllib.error.URLError, OSError, ValueError, KeyError, IndexError):
            if proc.poll() is not None:
                raise server.fail(f"exited with {proc.returncode} while starting") from None
            if time.monotonic() > deadline:
                stop_processes([proc], grace=5)
                raise server.fail(f"did not answer within {timeout:.0f} s") from None
            time.sleep(0.5)
    server.load_s = time.perf_counter() - t0
    return server


def start_rlfleet(args: argparse.Namespace, workdir: Path) -> Server:
    home = workdir / "rlfleet-home"
    home.mkdir()
    (home / "config.toml").write_text(f'[chat]\nengine = "{args.engine}"\n')
    threads = str(args.threads)
    env = {k: v for k, v in os.environ.items()
           if k not in ("REDIS_URL", "DATABASE_URL", "RLFLEET_THRESHOLD", "RLFLEET_PRESET")}
    env.update(RLFLEET_HOME=str(home), RLFLEET_MODEL=args.model, OMP_NUM_THREADS=threads,
               MKL_NUM_THREADS=threads, TOKENIZERS_PARALLELISM="false")
    cmd = [sys.executable, "-m", "rlfleet.cli", "serve", "--host", "127.0.0.1", "--port", str(free_port())]
    return start("rlfleet", cmd, env, workdir, args.start_timeout)


def engine_of(server: Server) -> str | None:
    """What draws rlfleet serve's tokens, as its /health says."""
    try:
        with urllib.request.urlopen(server.url.removesuffix("/v1") + "/health", timeout=10) as resp:
            return json.load(resp).get("engine")
    except (urllib.error.URLError, OSError, ValueError):
        return None


# llama.cpp's server with its weights left unrepacked (llama_model_params.use_extra_bufts, which its
# Python server does not expose): for a CPU that advertises units it refuses (AMX under some
# hypervisors), where the repacked server dies on its first token.
NO_REPACK = """
import runpy, sys
import llama_cpp.llama_cpp as C
default = C.llama_model_default_params
def params():
    p = default()
    p.use_extra_bufts = False
    return p
C.llama_model_default_params = params
runpy.run_module("llama_cpp.server", run_name="__main__", alter_sys=True)
"""


def repacks(args: argparse.Namespace, gguf: Path) -> bool:
    """Whether llama.cpp's server may repack its weights here: ``--llamacpp-repack``, or on ``auto``
    what rlfleet's own probe of this CPU finds (the same llama.cpp, in this venv)."""
    if args.llamacpp_repack != "auto":
        return args.llamacpp_repack == "on"
    from rlfleet.shared import llamacpp_engine

    return not llamacpp_engine.available() or llamacpp_engine.decodes(gguf, True)


def start_llamacpp(args: argparse.Namespace, gguf: Path, workdir: Path) -> Server:
    threads = str(args.threads)
    env = {**os.environ, "OMP_NUM_THREADS": threads}
    args.llamacpp_repacked = repacks(args, gguf)
    run = ["-m", "llama_cpp.server"] if args.llamacpp_repacked else ["-c", NO_REPACK]
    cmd = [str(args.llamacpp_python), *run, "--model", str(gguf), "--host", "127.0.0.1",
           "--port", str(free_port()), "--n_threads", threads, "--n_threads_batch", threads,
           "--n_ctx", str(args.n_ctx)]
    return start("llamacpp", cmd, env, workdir, args.start_timeout)


def gguf_of(model: str) -> Path | None:
    """The GGUF file a model spec loads from, or None (a Hugging Face folder: llama.cpp cannot serve it)."""
    from rlfleet.shared.config import DEFAULT_MODEL
    from rlfleet.shared.models import resolve_model

    ref = resolve_model(DEFAULT_MODEL if model == "default" else model)
    return Path(ref.path) / ref.gguf_file if ref.gguf_file else None


# -- the clients -----------------------------------------------------------------------------------


@dataclass
class Reply:
    tokens: int | None  # usage.completion_tokens (None: a stream that sent no usage chunk)
    seconds: float  # send to last byte
    first_s: float | None = None  # streamed: send to the first chunk with content
    finish: str | None = None


@dataclass
class Phase:
    """One phase on one server: what was sent, what came back, and the wall time it took."""

    kind: str  # "single", "ttft" or "c{N}"
    clients: int
    replies: list[Reply] = field(default_factory=list)
    wall_s: float = 0.0

    def as_dict(self) -> dict:
        counted = all(r.tokens is not None for r in self.replies)
        tokens = sum(r.tokens or 0 for r in self.replies) if counted else None
        out = {"kind": self.kind, "clients": self.clients, "answers": len(self.replies), "tokens": tokens,
               "wall_s": self.wall_s, "answers_per_s": len(self.replies) / self.wall_s,
               "tokens_per_s": None if tokens is None else tokens / self.wall_s,
               "stopped": sum(r.finish == "stop" for r in self.replies)}
        firsts = [r.first_s for r in self.replies if r.first_s is not None]
        if self.kind == "ttft":  # an answer that is only its end token has no first content chunk
            out["ttft_s"] = statistics.median(firsts) if firsts else None
            out["ttft_all_s"] = firsts
            out["answer_s"] = [r.seconds for r in self.replies]
        return out


def body(args: argparse.Namespace, server: Server, i: int, stream: bool) -> dict:
    """Request ``i``: prompt ``i`` of the list (wrapping round) and seed ``--seed + i``, for either server."""
    req = {
        "model": server.model,
        "messages": [{"role": "system", "content": SYSTEM},
                     {"role": "user", "content": PROMPTS[i % args.prompts]}],
        "max_tokens": args.max_tokens, "temperature": args.temperature, "top_p": args.top_p,
        "seed": args.seed + i,
        # llama.cpp's own samplers, off (rlfleet ignores these fields and samples exactly temperature/top-p)
        "top_k": 0, "min_p": 0.0, "repeat_penalty": 1.0, "presence_penalty": 0.0, "frequency_penalty": 0.0,
    }
    if stream:
        req |= {"stream": True, "stream_options": {"include_usage": True}}
    return req


async def ask(session, args: argparse.Namespace, server: Server, i: int, stream: bool = False) -> Reply:
    import aiohttp

    try:
        return await _ask(session, args, server, i, stream)
    except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
        code = server.proc.poll()
        raise server.fail(f"did not answer request {i} ({type(exc).__name__}: {exc}"
                          f"{'' if code is None else f'; it exited with {code}'})") from None


async def _ask(session, args: argparse.Namespace, server: Server, i: int, stream: bool) -> Reply:
    t0 = time.perf_counter()
    async with session.post(f"{server.url}/chat/completions", json=body(args, server, i, stream)) as resp:
        if resp.status != 200:
            raise server.fail(f"answered HTTP {resp.status}: {(await resp.text())[:300]}")
        if not stream:
            reply = await resp.json()
            choice = reply["choices"][0]
            return Reply(int(reply["usage"]["completion_tokens"]), time.perf_counter() - t0,
                         finish=choice.get("finish_reason"))
        first: float | None = None
        tokens: int | None = None
        finish = None
        async for raw in resp.content:
            line = raw.decode().strip()
            if not line.startswith("data:"):
                continue
            data = line.removeprefix("data:").strip()
            if data == "[DONE]":
                break
            chunk = json.loads(data)
            if "error" in chunk:
                raise server.fail(f"failed mid-stream: {chunk['error']}")
            for choice in chunk.get("choices") or []:
                if first is None and (choice.get("delta") or {}).get("content"):
                    first = time.perf_counter() - t0
                finish = choice.get("finish_reason") or finish
            if chunk.get("usage"):
                tokens = int(chunk["usage"]["completion_tokens"])
        return Reply(tokens, time.perf_counter() - t0, first_s=first, finish=finish)


async def run_phase(args: argparse.Namespace, server: Server, kind: str, clients: int,
                    on_answer: Callable[[], None]) -> Phase:
    """``single``/``ttft``: the prompts one after another (``ttft`` streamed); ``cN``: N clients, each
    sending ``--per-client`` requests back to back; requests are numbered the same on both servers."""
    import aiohttp

    phase = Phase(kind, clients)
    timeout = aiohttp.ClientTimeout(total=args.request_timeout)
    async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0)) as session:
        async def client(numbers: list[int], stream: bool) -> None:
            for i in numbers:
                phase.replies.append(await ask(session, args, server, i, stream))
                on_answer()

        t0 = time.perf_counter()
        if kind in ("single", "ttft"):
            await client(list(range(args.prompts)), stream=kind == "ttft")
        else:
            n = args.per_client
            await asyncio.gather(*(client([c * n + j for j in range(n)], False) for c in range(clients)))
        phase.wall_s = time.perf_counter() - t0
    return phase


def phases(args: argparse.Namespace) -> list[tuple[str, int]]:
    return [("single", 1), ("ttft", 1)] + [(f"c{c}", c) for c in args.clients]


def answers_per_round(args: argparse.Namespace) -> int:
    return sum(args.prompts if kind in ("single", "ttft") else c * args.per_client for kind, c in phases(args))


def run_rounds(args: argparse.Namespace, servers: dict[str, Server]) -> list[dict]:
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    names = list(servers)
    results: list[dict] = []
    bar_cols = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with Progress(*bar_cols, console=Console(stderr=True), transient=True) as bar:
        total = args.rounds * len(names) * answers_per_round(args)
        task = bar.add_task("bench.serve", total=total)
        for r in range(args.rounds):
            order = names[r % len(names):] + names[: r % len(names)]
            for kind, clients in phases(args):
                for name in order:
                    bar.update(task, description=f"round {r + 1}/{args.rounds} · {NAMES[name]} · {kind}")
                    phase = asyncio.run(run_phase(args, servers[name], kind, clients,
                                                  lambda: bar.advance(task)))
                    results.append({"round": r + 1, "server": name, **phase.as_dict()})
    return results


def warm_up(args: argparse.Namespace, servers: dict[str, Server]) -> None:
    import aiohttp

    async def once(server: Server) -> None:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=args.request_timeout)) as s:
            await ask(s, args, server, 0)

    for server in servers.values():
        asyncio.run(once(server))


# -- the figures -----------------------------------------------------------------------------------


def summarise(results: list[dict], args: argparse.Namespace) -> dict:
    """Medians over rounds per server, and ours over llama.cpp's where both ran."""
    fig: dict = {}
    for name in SERVERS:
        mine = [r for r in results if r["server"] == name]

        def med(kind: str, key: str, mine: list[dict] = mine) -> float | None:
            vals = [r[key] for r in mine if r["kind"] == kind and r[key] is not None]
            return statistics.median(vals) if vals else None

        fig[f"{name}_tps"] = med("single", "tokens_per_s")
        fig[f"{name}_ttft_s"] = med("ttft", "ttft_s")
        single = [r for r in mine if r["kind"] == "single"]
        fig[f"{name}_tokens_per_answer"] = (sum(r["tokens"] for r in single) / sum(r["answers"] for r in single)
                                            if single else None)
        for c in args.clients:
            fig[f"{name}_aps{c}"] = med(f"c{c}", "answers_per_s")
    keys = ["tps", "ttft_s", "tokens_per_answer"] + [f"aps{c}" for c in args.clients]
    for k in keys:
        ours, theirs = fig.get(f"rlfleet_{k}"), fig.get(f"llamacpp_{k}")
        fig[f"{k}_ratio"] = ours / theirs if ours is not None and theirs else None
    return fig


def table(fig: dict, args: argparse.Namespace) -> str:
    def show(v: float | None, fmt: str) -> str:
        return "–" if v is None else format(v, fmt)

    rows = [("single-stream tokens/s", "tps", ",.1f"), ("time to first token (s, median)", "ttft_s", ".3f"),
            *[(f"answers/s, {c} client{'s' if c > 1 else ''}", f"aps{c}", ".3f") for c in args.clients],
            ("completion tokens per answer", "tokens_per_answer", ".1f")]
    body = [[label, show(fig.get(f"rlfleet_{k}"), f), show(fig.get(f"llamacpp_{k}"), f),
             "–" if fig.get(f"{k}_ratio") is None else f"{fig[f'{k}_ratio']:.2f}×"] for label, k, f in rows]
    text = markdown_table(["figure", NAMES["rlfleet"], NAMES["llamacpp"], "rlfleet / llama.cpp"], body)
    loads = ", ".join(f"{NAMES[n]} {fig['load_s'][n]:.0f} s" for n in fig["load_s"])
    return text + (f"\n\nMedians of {args.rounds} interleaved round(s); {args.threads} thread(s) each; "
                   f"{args.prompts} prompts, max_tokens {args.max_tokens}, temperature {args.temperature}, "
                   f"top_p {args.top_p}; {args.per_client} request(s) per client. From start to answering "
                   f"/v1/models: {loads}. rlfleet serve's tokens drawn by: {fig.get('rlfleet_engine') or '–'}.")


def parse(argv: list[str] | None) -> argparse.Namespace:
    from rlfleet.shared.config import ChatSettings

    chat = ChatSettings()
    ap = parser("bench.serve", __doc__)
    ap.add_argument("--model", default="default",
                    help="default (the default model's GGUF) | a model folder or .gguf file (llama.cpp needs a GGUF)")
    ap.add_argument("--servers", default=",".join(SERVERS), help="comma list of rlfleet, llamacpp (default both)")
    ap.add_argument("--engine", choices=("auto", "torch", "llama.cpp"), default="auto",
                    help="rlfleet serve's chat.engine (default auto: llama.cpp where this venv has it)")
    default_python = os.environ.get("LLAMACPP_PYTHON", LLAMACPP_PYTHON)
    ap.add_argument("--llamacpp-python", type=Path,
                    default=Path(default_python) if Path(default_python).exists() else None,
                    help=f"the Python of llama-cpp-python's venv (default {LLAMACPP_PYTHON} if it exists)")
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="threads per server (default: all cores)")
    ap.add_argument("--rounds", type=int, default=2, help="interleaved rounds; medians are reported (default 2)")
    ap.add_argument("--prompts", type=int, default=len(PROMPTS),
                    help=f"prompts per single-stream and time-to-first-token pass (default {len(PROMPTS)})")
    ap.add_argument("--clients", type=lambda s: [int(c) for c in s.split(",")], default=list(CLIENTS),
                    help="concurrent clients per answers/s phase (default 1,4,16)")
    ap.add_argument("--per-client", type=int, default=2, help="requests each client sends back to back (default 2)")
    ap.add_argument("--max-tokens", type=int, default=64, help="max_tokens per request (default 64)")
    ap.add_argument("--temperature", type=float, default=chat.temperature,
                    help=f"default {chat.temperature}: the chat's")
    ap.add_argument("--top-p", type=float, default=chat.top_p, help=f"default {chat.top_p}: the chat's")
    ap.add_argument("--seed", type=int, default=1000, help="request i is sent with seed SEED + i (default 1000)")
    ap.add_argument("--n-ctx", type=int, default=2048, help="llama.cpp's context window (default 2048)")
    ap.add_argument("--llamacpp-repack", choices=("auto", "on", "off"), default="auto",
                    help="llama.cpp's server repacks weights for this CPU's special units (default auto: where "
                         "rlfleet's probe finds they decode here)")
    ap.add_argument("--start-timeout", type=float, default=300, help="seconds a server may take to start")
    ap.add_argument("--request-timeout", type=float, default=600, help="seconds one request may take")
    output_options(ap)
    args = ap.parse_args(argv)
    args.servers = [s.strip() for s in args.servers.split(",") if s.strip()]
    unknown = sorted(set(args.servers) - set(SERVERS))
    if unknown or not args.servers:
        ap.error(f"--servers takes {', '.join(SERVERS)}; got {', '.join(unknown) or 'none'}")
    if not 1 <= args.prompts <= len(PROMPTS):
        ap.error(f"--prompts must be 1 to {len(PROMPTS)}")
    if min(args.rounds, args.threads, args.per_client, args.max_tokens, *args.clients) < 1:
        ap.error("--rounds, --threads, --per-client, --max-tokens and --clients must be at least 1")
    return args


def check_llamacpp(args: argparse.Namespace) -> Path:
    """The GGUF llama.cpp will serve, after checking its venv is there; else one line with the fix."""
    python = args.llamacpp_python
    how = ("build its venv as bench/serve.py's docstring says (python -m bench.serve --help), pass "
           "--llamacpp-python, or run ours alone with --servers rlfleet")
    if python is None or not Path(python).exists():
        raise SystemExit(f"no llama.cpp venv at {python or LLAMACPP_PYTHON}: {how}")
    gguf = gguf_of(args.model)
    if gguf is None:
        raise SystemExit(f"llama.cpp serves GGUF files only and {args.model} is not one; pass a .gguf model "
                         "or --servers rlfleet")
    probe = subprocess.run([str(python), "-c", "import llama_cpp.server"], capture_output=True, text=True)
    if probe.returncode != 0:
        last = (probe.stderr.strip().splitlines() or ["?"])[-1]
        raise SystemExit(f"{python} cannot import llama_cpp.server ({last}): {how}")
    return gguf


def main(argv: list[str] | None = None) -> dict:
    args = parse(argv)
    gguf = check_llamacpp(args) if "llamacpp" in args.servers else None
    if args.model == "default":
        from rlfleet.shared.config import DEFAULT_MODEL

        args.model = DEFAULT_MODEL
    servers: dict[str, Server] = {}
    with ExitStack() as stack:
        workdir = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="bench-serve-")))
        stack.callback(lambda: stop_processes([s.proc for s in servers.values()], grace=10))
        from rich.console import Console

        with Console(stderr=True).status("starting the servers…"):
            for name in args.servers:  # one after the other: loading competes for the same cores
                servers[name] = start_rlfleet(args, workdir) if name == "rlfleet" else \
                    start_llamacpp(args, gguf, workdir)  # type: ignore[arg-type]
            warm_up(args, servers)
        engines = {n: engine_of(s) for n, s in servers.items() if n == "rlfleet"}
        results = run_rounds(args, servers)
    fig = summarise(results, args)
    fig |= {"load_s": {n: s.load_s for n, s in servers.items()}, "servers": list(servers), "model": args.model,
            "rlfleet_engine": engines.get("rlfleet"), "llamacpp_repacked": getattr(args, "llamacpp_repacked", None),
            "gguf": str(gguf) if gguf else None, "threads": args.threads, "rounds": args.rounds,
            "prompts": args.prompts, "clients": args.clients, "per_client": args.per_client,
            "max_tokens": args.max_tokens, "temperature": args.temperature, "top_p": args.top_p,
            "results": results}
    publish(fig, table(fig, args), args,
            f"`bench.serve` · {args.model} · {args.threads} thread(s) · {' vs '.join(NAMES[n] for n in servers)}")
    return fig


if __name__ == "__main__":
    main()
