"""Locust users that chat with pagedserve over SSE, as a chat frontend does.

Each user posts ``/v1/chat/completions`` with ``stream: true`` and reads the event stream
line by line. Besides locust's own row for the request, three custom rows are reported
(request type ``SSE``): ``ttft`` (ms to the first content delta), ``itl`` (ms between deltas,
one sample per gap) and ``tokens`` (delta count per request, shown in the response-length
column).

A share of users disconnects mid-stream (``--disconnect-share 0.25`` or env
``PAGEDSERVE_DISCONNECT_SHARE``): after a few deltas they close the connection, which must make
the server free the request's KV blocks. Their requests count as successes (row
``chat [disconnect]``). The share is exact, not drawn: of every 4 users started, 1 hangs up at
0.25 (so a short run always has both kinds).

    locust -f loadtest/locustfile.py --headless -u 8 -r 4 -t 60s --host http://127.0.0.1:8000 \
        --max-tokens 64 --disconnect-share 0.25
"""

from __future__ import annotations

import json
import os
import random
import time

from locust import HttpUser, between, events, task

TOPICS = ["the sea", "a mountain village", "winter bread", "a quiet river", "old machines",
          "learning to cook", "the night sky", "a school garden", "city music", "a long letter"]
ASKS = ["Write a short poem about {}.", "Tell me three facts about {}.",
        "Describe {} in two sentences.", "Write a short story about {}."]


@events.init_command_line_parser.add_listener
def _add_arguments(parser) -> None:
    parser.add_argument("--model", default=os.environ.get("PAGEDSERVE_MODEL",
                        "HuggingFaceTB/SmolLM2-135M-Instruct"), help="model name to send")
    parser.add_argument("--max-tokens", type=int,
                        default=int(os.environ.get("PAGEDSERVE_MAX_TOKENS", "64")),
                        help="max_tokens per request (EOS ignored, so exactly this many)")
    parser.add_argument("--disconnect-share", type=float,
                        default=float(os.environ.get("PAGEDSERVE_DISCONNECT_SHARE", "0")),
                        help="share of users that drop the stream after a few deltas")


def _fire(env, name: str, value: float, length: int = 0) -> None:
    env.events.request.fire(request_type="SSE", name=name, response_time=value,
                            response_length=length, exception=None, context={})


class ChatUser(HttpUser):
    wait_time = between(0.1, 0.5)
    started = 0  # users started so far, for the exact disconnect share

    def on_start(self) -> None:
        opts = self.environment.parsed_options
        self.model = getattr(opts, "model", "HuggingFaceTB/SmolLM2-135M-Instruct")
        self.max_tokens = getattr(opts, "max_tokens", 64)
        share = getattr(opts, "disconnect_share", 0.0)
        i = ChatUser.started
        ChatUser.started += 1
        # user i hangs up when the running count of hang-ups, i * share rounded down, steps up
        self.disconnects = int((i + 1) * share) > int(i * share)

    @task
    def chat(self) -> None:
        prompt = random.choice(ASKS).format(random.choice(TOPICS))
        body = {"model": self.model, "messages": [{"role": "user", "content": prompt}],
                "stream": True, "max_tokens": self.max_tokens, "temperature": 0,
                "ignore_eos": True}
        # Drop somewhere in the first half of the stream.
        drop_after = random.randint(1, max(1, self.max_tokens // 2)) if self.disconnects else None
        name = "chat [disconnect]" if drop_after else "chat"
        start = time.perf_counter()
        last = None
        deltas = 0
        with self.client.post("/v1/chat/completions", json=body, stream=True, name=name,
                              catch_response=True) as resp:
            if resp.status_code != 200:
                resp.failure(f"HTTP {resp.status_code}: {resp.text[:200]}")
                return
            done = False
            for line in resp.iter_lines(decode_unicode=True):
                if not line or not line.startswith("data: "):
                    continue
                data = line[len("data: "):]
                if data == "[DONE]":
                    done = True
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    resp.failure(f"stream error: {chunk['error']}")
                    return
                if not chunk["choices"][0]["delta"].get("content"):
                    continue
                now = time.perf_counter()
                if last is None:
                    _fire(self.environment, "ttft", (now - start) * 1000)
                else:
                    _fire(self.environment, "itl", (now - last) * 1000)
                last = now
                deltas += 1
                if drop_after and deltas >= drop_after:
                    resp.raw.close()  # the browser tab closes: the connection goes away
                    resp.success()
                    return
            if not done:
                resp.failure("stream ended without [DONE]")
                return
            _fire(self.environment, "tokens", (time.perf_counter() - start) * 1000, deltas)
            resp.success()
