"""`rlfleet serve` as a user starts it, on the tiny model: asked through the official OpenAI client, it
answers from the base, switches to a newly promoted adapter on the next request, streams an answer
as it is generated, and refuses bad requests with OpenAI-shaped errors."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time

import pytest

torch = pytest.importorskip("torch")
openai = pytest.importorskip("openai")

from peft import LoraConfig, get_peft_model  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402

from rlfleet.shared.models import resolve_model  # noqa: E402
from rlfleet.shared.registry import AdapterRegistry  # noqa: E402
from rlfleet.shared.serve import MAX_BODY_BYTES  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore:.*is_gradient_checkpointing:FutureWarning")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def served(home, tiny_model_dir):
    port = _free_port()
    env = {**os.environ, "RLFLEET_HOME": str(home), "RLFLEET_MODEL": str(tiny_model_dir), "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "rlfleet.cli", "serve", "--port", str(port)], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0, timeout=30)
    deadline = time.monotonic() + 90
    while True:
        try:
            client.models.list()
            break
        except openai.APIConnectionError:
            if proc.poll() is not None or time.monotonic() > deadline:
                proc.kill()
                raise AssertionError(f"rlfleet serve did not start:\n{proc.stdout.read()}") from None
            time.sleep(0.3)
    try:
        yield client, port, AdapterRegistry(home / "adapters", resolve_model(str(tiny_model_dir)).slug)
    finally:
        proc.terminate()
        proc.wait(timeout=20)


def ask(client, **kw):
    return client.chat.completions.create(
        model=kw.pop("model", client.models.list().data[0].id),
        messages=kw.pop("messages", [{"role": "user", "content": "Say something about tests."}]),
        temperature=0, max_tokens=kw.pop("max_tokens", 12), logprobs=True, **kw)


def test_answers_switch_when_a_new_adapter_is_promoted(served, tiny_model_dir):
    client, _, registry = served
    base = ask(client)
    assert base.system_fingerprint == "rlfleet-base"
    ours = base.model_extra["rlfleet"]
    assert ours["adapter_version"] is None and len(ours["token_ids"]) == len(ours["logprobs"]) > 0
    assert [t.logprob for t in base.choices[0].logprobs.content] == pytest.approx(ours["logprobs"])
    eos = AutoTokenizer.from_pretrained(tiny_model_dir).eos_token_id  # the cap, or the model, ended it
    assert base.choices[0].finish_reason == ("stop" if ours["token_ids"][-1] == eos else "length")
    assert base.choices[0].finish_reason == "stop" or len(ours["token_ids"]) == 12

    torch.manual_seed(7)  # a non-identity adapter, written where training would write it
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    lora = LoraConfig(r=4, lora_alpha=4, target_modules="all-linear", init_lora_weights=False)
    get_peft_model(model, lora).save_pretrained(registry.path("v0001"))
    registry.set_current("v0001")  # what promotion does

    tuned = ask(client)
    assert tuned.system_fingerprint == "rlfleet-v0001"
    assert tuned.model_extra["rlfleet"]["adapter_version"] == "v0001"
    assert tuned.model_extra["rlfleet"]["token_ids"] != ours["token_ids"]  # greedy: the weights changed

    registry.set_current(None)  # rollback to the base: the same greedy answer as before
    assert ask(client).model_extra["rlfleet"]["token_ids"] == ours["token_ids"]


def test_bad_requests_get_openai_shaped_errors(served):
    import urllib.error
    import urllib.request

    client, port, _ = served
    with pytest.raises(openai.NotFoundError, match="is not served here"):
        ask(client, model="gpt-4o")
    name = client.models.list().data[0].id
    assert client.models.retrieve(name).id == name and client.models.retrieve(f"{name}@person:slack:U1").id
    with pytest.raises(openai.NotFoundError, match="is not served here"):
        client.models.retrieve("gpt-4o")
    body = b'{"messages": [{"role": "user", "content": "Hi"}], "temperature": NaN}'  # (the client cannot send it)
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/chat/completions", data=body, method="POST",
                                 headers={"Content-Type": "application/json"})
    with pytest.raises(urllib.error.HTTPError) as nan:
        urllib.request.urlopen(req, timeout=10)
    assert nan.value.code == 400 and b"less than or equal" not in nan.value.read()
    # A prompt within the character cap is not refused for its bytes, however JSON escapes it.
    with pytest.raises(openai.BadRequestError) as exc:
        client.chat.completions.create(model=name, messages=[{"role": "user", "content": "\u2603" * 399_000}])
    assert exc.value.code == "context_length_exceeded"
    with pytest.raises(openai.BadRequestError, match="no non-empty user message"):
        client.chat.completions.create(model="x", messages=[{"role": "user", "content": " "}])
    with pytest.raises(openai.BadRequestError, match="prefill the answer continues"):
        client.chat.completions.create(model="x", messages=[{"role": "user", "content": "Hi"},
                                                            {"role": "assistant", "content": ""}])
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/chat/completions", data=b"{oops", method="POST",
                                 headers={"Content-Type": "application/json"})
    with pytest.raises(urllib.error.HTTPError) as exc:
        urllib.request.urlopen(req, timeout=10)
    assert exc.value.code == 400 and b"invalid request" in exc.value.read()
    # aiohttp's own refusals in OpenAI's shape too: no such route, a wrong method, a body over the cap
    for method, path, data, code, words in [
        ("POST", "/v1/completions", b"{}", 404, "no such endpoint: POST /v1/completions"),
        ("GET", "/v1/chat/completions", None, 405, "GET /v1/chat/completions: use POST"),
        ("POST", "/v1/chat/completions", b"x" * (MAX_BODY_BYTES + 1), 413, "Maximum request body size"),
    ]:
        req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", data=data, method=method,
                                     headers={"Content-Type": "application/json"})
        with pytest.raises(urllib.error.HTTPError) as exc:
            urllib.request.urlopen(req, timeout=10)
        error = json.loads(exc.value.read())["error"]
        assert exc.value.code == code and words in error["message"] and error["type"].endswith("_error"), error


def test_a_conversation_longer_than_the_models_context_is_refused_at_once(served):
    """Past its trained context a model answers nonsense, slowly, holding every other request: the
    server refuses it before it waits, as OpenAI does (`context_length_exceeded`), streamed or not,
    and answers the next request as usual."""
    client, _, _ = served
    long = " ".join(f"w{i}" for i in range(3000))  # the tiny model reads 1,024 tokens
    for stream in (False, True):
        t0 = time.monotonic()
        with pytest.raises(openai.BadRequestError) as exc:
            client.chat.completions.create(model=client.models.list().data[0].id, max_tokens=8, stream=stream,
                                           messages=[{"role": "user", "content": long}])
        assert exc.value.code == "context_length_exceeded" and "reads at most 1,024" in exc.value.message
        assert time.monotonic() - t0 < 10
    assert ask(client).choices[0].message.content is not None


def test_an_answer_stops_where_the_context_ends(tiny_model_dir, tmp_path, single_thread):
    from rlfleet.shared.errors import ContextTooLong
    from rlfleet.shared.responder import LocalResponder

    r = LocalResponder(resolve_model(str(tiny_model_dir)), tmp_path / "adapters", temperature=0, max_new_tokens=64)
    def convo_of(words: int) -> list[dict]:
        return [{"role": "user", "content": " ".join(["tok"] * words)}]

    words = 100
    while r.check_fits(convo_of(words + 1)) < 1000:
        words += 1
    convo = convo_of(words + 1)
    one, (many,) = r.answer(convo), r.answer_many([convo])
    for a in (one, many):
        assert 1000 <= a.prompt_tokens and a.prompt_tokens + a.new_tokens <= r.context_tokens == 1024
    with pytest.raises(ContextTooLong, match="start a new conversation"):
        r.answer(convo_of(words * 2))
    # A chat's long past gives way, a turn at a time from the earliest, to a whole answer's room.
    turn = " ".join(["tok"] * (words // 4))
    chat = [{"role": "system", "content": "Be brief."}]
    for i in range(8):
        chat += [{"role": "user", "content": f"q{i} {turn}"}, {"role": "assistant", "content": f"a{i} {turn}"}]
    chat.append({"role": "user", "content": "last"})
    fitted = r.fit_history(chat)
    assert fitted[0] == chat[0] and fitted[-1] == chat[-1] and fitted == chat[:1] + chat[len(chat) - len(fitted) + 1:]
    assert fitted[1]["role"] == "user" and len(fitted) < len(chat)
    assert r.check_fits(fitted) + r.max_new_tokens <= r.context_tokens
    with pytest.raises(ContextTooLong):
        r.check_fits(chat)
    with pytest.raises(ContextTooLong):
        r.fit_history(chat[:-1] + convo_of(words * 2))
    # A last message that leaves less than a whole answer's room, but some, is answered (shorter);
    # a refusal counts the conversation's own tokens.
    assert r.fit_history(chat[:1] + convo) == chat[:1] + convo
    n = r.check_fits(convo)
    with pytest.raises(ContextTooLong, match=f"the conversation is {n:,} tokens"):
        r.check_fits(convo, room=r.max_new_tokens)


def test_an_address_it_cannot_listen_on_is_one_line_before_the_model_loads(home, tiny_model_dir):
    """A port in use, a port that is none, an address of another machine: `serve`, `web` and `bridge`
    say so on one line (before `serve` and `web` load the model), not with a trace after it."""
    env = {**os.environ, "RLFLEET_HOME": str(home), "RLFLEET_MODEL": str(tiny_model_dir)}
    assert subprocess.run([sys.executable, "-m", "rlfleet.cli", "init", "--yes", "--no-check-model"], env=env,
                          capture_output=True, timeout=60).returncode == 0
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = str(taken.getsockname()[1])
        for args, words in [(["serve", "--port", port], f"port {port} on 127.0.0.1 is in use"),
                            (["web", "--port", port, "--no-worker"], f"port {port} on 127.0.0.1 is in use"),
                            (["bridge", "--port", port], f"port {port} on 127.0.0.1 is in use"),
                            (["serve", "--port", "99999"], "99999 is not a port"),
                            (["serve", "--host", "192.0.2.1", "--port", "0"], "is not an address of this machine")]:
            res = subprocess.run([sys.executable, "-m", "rlfleet.cli", *args], env=env, capture_output=True,
                                 text=True, timeout=60)
            assert res.returncode != 0 and words in res.stderr, (args, res.stderr[-2000:])
            assert "Traceback" not in res.stderr and "loading" not in res.stderr + res.stdout, args
            assert "serving" not in res.stdout, args


def test_stop_strings_end_the_answer_whole_or_streamed_and_what_is_not_served_is_refused(served):
    client, _, _ = served
    name = client.models.list().data[0].id

    def sampled(seed: int, **kw):
        return client.chat.completions.create(model=name, messages=[{"role": "user", "content": "Say more."}],
                                              max_tokens=24, temperature=1.0, seed=seed, **kw)

    seed = next(s for s in range(20) if len(sampled(s).choices[0].message.content.strip()) > 8)
    full = sampled(seed)
    text, ids = full.choices[0].message.content, full.model_extra["rlfleet"]["token_ids"]
    stop = text[len(text) // 2:len(text) // 2 + 3]
    at = text.find(stop)
    cut = sampled(seed, stop=[stop, "never in it \u2603"])
    assert cut.choices[0].message.content == text[:at] and cut.choices[0].finish_reason == "stop"
    kept = cut.model_extra["rlfleet"]["token_ids"]
    assert kept == ids[:len(kept)] and len(kept) < len(ids) and cut.usage.completion_tokens == len(kept)
    chunks = list(sampled(seed, stop=stop, stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices).strip() == text[:at].strip()
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["stop"]
    assert ask(client, messages=[{"role": "developer", "content": "Be brief."},
                                 {"role": "user", "content": "Hi"}]).choices[0].message.content is not None
    for extra, words in [({"tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}]}, "tools"),
                         ({"response_format": {"type": "json_object"}}, "response_format"),
                         ({"top_logprobs": 3}, "top_logprobs"), ({"stop": ["a", "b", "c", "d", "e"]}, "stop"),
                         ({"messages": [{"role": "user", "content": "Hi"},
                                        {"role": "tool", "content": "42", "tool_call_id": "x"}]}, "tool calls")]:
        with pytest.raises(openai.BadRequestError) as exc:
            ask(client, **extra)
        assert words in exc.value.message, (extra, exc.value.message)


def test_a_streamed_answer_is_the_same_answer_piece_by_piece(served):
    client, port, _ = served
    whole = ask(client, max_tokens=24, seed=3)
    chunks = list(ask(client, max_tokens=24, seed=3, stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    texts = [c.choices[0].delta.content for c in chunks if c.choices and c.choices[0].delta.content]
    assert len(texts) > 1  # pieces as they came, not one block at the end
    assert "".join(texts).strip() == whole.choices[0].message.content
    last = next(c for c in chunks if c.choices and c.choices[0].finish_reason)
    assert last.choices[0].finish_reason == whole.choices[0].finish_reason
    # The behaviour policy rides on the closing chunk, as in the whole reply.
    assert last.model_extra["rlfleet"]["token_ids"] == whole.model_extra["rlfleet"]["token_ids"]
    assert last.model_extra["rlfleet"]["logprobs"] == pytest.approx(whole.model_extra["rlfleet"]["logprobs"])
    assert [t.logprob for t in last.choices[0].logprobs.content] == pytest.approx(
        whole.model_extra["rlfleet"]["logprobs"])
    assert chunks[-1].choices == [] and chunks[-1].usage == whole.usage
    assert len({c.id for c in chunks}) == 1


def test_a_client_that_hangs_up_mid_stream_leaves_the_server_answering(served):
    client, port, _ = served
    body = json.dumps({"messages": [{"role": "user", "content": "Say something long."}], "max_tokens": 200,
                       "stream": True}).encode()
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
        assert b"200" in sock.recv(64)  # the stream began; now hang up
    assert ask(client).choices[0].message.content is not None
    events = []
    with client.chat.completions.with_streaming_response.create(
            model=client.models.list().data[0].id, messages=[{"role": "user", "content": "Hi"}], max_tokens=8,
            stream=True) as raw:
        events = [line for line in raw.iter_lines() if line]
    assert events[-1] == "data: [DONE]" and all(e.startswith("data: ") for e in events)


def test_requests_that_wait_are_answered_together_each_with_its_own_answer(served):
    client, _, _ = served
    model = client.models.list().data[0].id
    prompts = [f"Tell me one thing about the number {i}." for i in range(6)]

    def one(prompt: str):
        return client.chat.completions.create(model=model, messages=[{"role": "user", "content": prompt}],
                                              temperature=0, max_tokens=10)

    alone = [one(p) for p in prompts]
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(6) as pool:
        together = list(pool.map(one, prompts))
    for a, t in zip(alone, together, strict=True):
        assert t.model_extra["rlfleet"]["token_ids"] == a.model_extra["rlfleet"]["token_ids"]
        assert t.model_extra["rlfleet"]["logprobs"] == pytest.approx(a.model_extra["rlfleet"]["logprobs"], abs=1e-4)
        assert t.choices[0].message.content == a.choices[0].message.content
        # OpenAI's usage, as clients read it: the prompt as the model read it, then the answer
        assert (t.usage.prompt_tokens, t.usage.completion_tokens) == (a.usage.prompt_tokens, a.usage.completion_tokens)
        assert a.usage.prompt_tokens > len(a.model_extra["rlfleet"]["messages"][-1]["content"].split())
        assert a.usage.total_tokens == a.usage.prompt_tokens + len(a.model_extra["rlfleet"]["token_ids"])


def test_the_batcher_answers_waiting_requests_in_one_generate(tiny_model_dir, tmp_path, single_thread):
    import asyncio

    from rlfleet.shared.responder import LocalResponder
    from rlfleet.shared.serve import Batcher

    r = LocalResponder(resolve_model(str(tiny_model_dir)), tmp_path / "adapters", temperature=0, max_new_tokens=8)
    batches: list[int] = []
    threads: set[str] = set()  # where the model computed (rlfleet.shared.compute_thread)
    real, real_one = r.answer_many, r.answer

    def counted(conversations, *args, **kw):
        batches.append(len(conversations))
        threads.add(threading.current_thread().name)
        return real(conversations, *args, **kw)

    def one(*args, **kw):
        threads.add(threading.current_thread().name)
        return real_one(*args, **kw)

    r.answer_many, r.answer = counted, one
    convs = [[{"role": "user", "content": f"Question {i}?"}] for i in range(6)]

    async def go():
        batcher = Batcher(r, asyncio.Lock(), max_batch=4)
        task = asyncio.create_task(batcher.run())
        try:
            same = await asyncio.gather(*(batcher.answer(c, None, None, None, None) for c in convs))
            # Other settings cannot share a generate: a request asking for fewer tokens goes apart.
            mixed = await asyncio.gather(batcher.answer(convs[0], None, 3, None, None),
                                         batcher.answer(convs[1], None, None, None, None))
        finally:
            task.cancel()
        return same, mixed

    same, mixed = asyncio.run(go())
    assert threads == {"rlfleet-compute"}  # every generate on the one thread, whichever request it served
    r.answer = real_one
    assert sum(batches[:2]) == 6 and max(batches) == 4  # six waiting, four at most at once
    assert [a.token_ids for a in same] == [r.answer(c).token_ids for c in convs]
    assert len(mixed[0].token_ids) <= 3 and mixed[1].token_ids == same[1].token_ids


def test_the_batcher_draws_nothing_for_a_client_that_left_while_it_waited(tiny_model_dir, tmp_path, single_thread):
    """aiohttp does not cancel a handler whose client hung up: the batcher asks each waiting request
    whether its client is still there before it draws, so abandoned requests cost no answer."""
    import asyncio

    from rlfleet.shared.responder import LocalResponder
    from rlfleet.shared.serve import Batcher

    r = LocalResponder(resolve_model(str(tiny_model_dir)), tmp_path / "adapters", temperature=0, max_new_tokens=8)
    drawn: list[str] = []
    real, real_one = r.answer_many, r.answer
    r.answer_many = lambda convs, *a, **kw: (drawn.extend(c[0]["content"] for c in convs), real(convs, *a, **kw))[1]
    r.answer = lambda conv, *a, **kw: (drawn.append(conv[0]["content"]), real_one(conv, *a, **kw))[1]

    async def go():
        batcher = Batcher(r, asyncio.Lock(), max_batch=8)
        task = asyncio.create_task(batcher.run())
        try:
            asks = [batcher.answer([{"role": "user", "content": f"Q{i}?"}], None, None, None, None,
                                   gone=lambda i=i: i % 2 == 1) for i in range(4)]
            return await asyncio.gather(*asks, return_exceptions=True)
        finally:
            task.cancel()

    answers = asyncio.run(go())
    assert sorted(drawn) == ["Q0?", "Q2?"]
    assert [type(a).__name__ for a in answers] == ["Answer", "CancelledError", "Answer", "CancelledError"]


def test_a_request_naming_a_scope_is_answered_by_that_scopes_adapter(served, tiny_model_dir):
    from rlfleet.shared import scopes

    client, _, registry = served
    name = client.models.list().data[0].id
    base = ask(client).model_extra["rlfleet"]
    alice = AdapterRegistry(registry.dir.parent, scopes.lineage(registry.slug, "person:slack:U1"))
    torch.manual_seed(11)  # alice's own version, written where her scope's run would write it
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    lora = LoraConfig(r=4, lora_alpha=4, target_modules="all-linear", init_lora_weights=False)
    get_peft_model(model, lora).save_pretrained(alice.path("v0001"))
    alice.set_current("v0001")

    by_name = ask(client, model=f"{name}@person:slack:U1").model_extra["rlfleet"]
    by_header = ask(client, extra_headers={"X-Rlfleet-Scope": "person:slack:U1"}).model_extra["rlfleet"]
    assert by_name["adapter_version"] == by_header["adapter_version"] == "v0001"
    assert by_name["token_ids"] == by_header["token_ids"] != base["token_ids"]  # greedy: her weights answered
    shared = ask(client).model_extra["rlfleet"]  # the shared lineage has no version: the base, as before
    assert shared["adapter_version"] is None and shared["token_ids"] == base["token_ids"]
    nobody = ask(client, extra_headers={"X-Rlfleet-Scope": "person:slack:U2"}).model_extra["rlfleet"]
    assert nobody["adapter_version"] is None and nobody["token_ids"] == base["token_ids"]

    with pytest.raises(openai.BadRequestError, match="is not a scope"):
        ask(client, extra_headers={"X-Rlfleet-Scope": "person:myspace:U1"})
    with pytest.raises(openai.BadRequestError, match="asks for scope"):
        ask(client, model=f"{name}@person:slack:U1", extra_headers={"X-Rlfleet-Scope": "person:slack:U2"})
    with pytest.raises(openai.NotFoundError, match="is not served here"):
        ask(client, model="other@person:slack:U1")
