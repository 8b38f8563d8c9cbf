"""Locust side of the load test: command-line options, the streaming user, the tier's load shape and the
end-of-run SLA evaluation (which sets Locust's exit code).

Custom rows in Locust's stats, CSV and HTML (request type, name = api):
  TTFT      response time = time to first token (ms)
  TPOT      response time = mean time per output token after the first (ms)
  ITL       response time = one inter-token gap (ms); a k-token chunk counts k gaps of gap/k
  USER_TPS  response time column = per-user tokens/s (not ms), size column = output tokens
Locust rounds response times for its percentiles; the SLA checks use the raw samples instead.
"""

from __future__ import annotations

import logging
import os
import sys
import time

from gevent import GreenletExit
from locust import LoadTestShape, events, task
from locust.contrib.fasthttp import FastHttpUser
from locust.exception import StopUser

from dspark_loadtest import server_metrics
from dspark_loadtest.report import build_report, write_report
from dspark_loadtest.run_state import LoadRun, resolve_tier
from dspark_loadtest.safety import DEFAULT_HOST, check_target
from dspark_loadtest.shapes import stage_at
from dspark_loadtest.stream import RequestSample, StreamError, StreamMeter
from dspark_loadtest.tiers import DEFAULT_TIERS_FILE, load_tiers

log = logging.getLogger("dspark_loadtest")


@events.init_command_line_parser.add_listener
def _add_options(parser) -> None:
    # A plain argparse group: these are fixed when the process starts (the run is built from them at
    # init), so they stay out of the web UI's form, and the API key is never shown there.
    g = parser.add_argument_group("DSpark SLA scenario")
    g.add_argument("--tier", default="", help="Tier to test (default: the first in the tier file)")
    g.add_argument("--tiers-file", default=str(DEFAULT_TIERS_FILE), help="Tier definitions (YAML)")
    g.add_argument("--concurrency", type=int, default=0, help="Override the tier's load: constant users")
    g.add_argument("--scenario-seconds", type=float, default=0, help="Override the tier's duration")
    g.add_argument("--api", default="", choices=["", "chat", "completions", "mixed"], help="Override the API")
    g.add_argument("--mix", default="", help="Override the domain mix, e.g. math=1,code=2,chat=1")
    g.add_argument("--prompt-words", type=int, default=-1, help="Override the minimum prompt length (words)")
    g.add_argument("--max-tokens", type=int, default=0, help="Override max_tokens per request")
    g.add_argument("--max-requests", type=int, default=0, help="Override the request cap")
    g.add_argument("--max-error-ratio", type=float, default=-1.0, help="Override the tolerated error ratio")
    g.add_argument("--model", default="", help="Model name (default: the server's first /v1/models entry)")
    g.add_argument("--api-prefix", default="/v1", help="Where the OpenAI routes live (/openai/v1 on KServe)")
    g.add_argument(
        "--api-key", default=os.environ.get("DSPARK_API_KEY", ""), help="Bearer token (or DSPARK_API_KEY)"
    )
    g.add_argument(
        "--report-prefix", default="", help="Report file prefix (default: --csv's, else dspark-loadtest)"
    )
    g.add_argument("--seed", type=int, default=0, help="Prompt sampling seed")


@events.init.add_listener
def _on_init(environment, **_kw) -> None:
    o = environment.parsed_options
    if o is None:  # library use without Locust's parser: the caller sets environment.dspark_run
        return
    try:
        host = check_target(environment.host or DEFAULT_HOST, user_given=True)
        tier = resolve_tier(
            load_tiers(o.tiers_file),
            o.tier or None,
            concurrency=o.concurrency or None,
            seconds=o.scenario_seconds or None,
            api=o.api or None,
            mix=o.mix or None,
            prompt_words=o.prompt_words if o.prompt_words >= 0 else None,
            max_tokens=o.max_tokens or None,
            max_requests=o.max_requests or None,
            max_error_ratio=o.max_error_ratio if o.max_error_ratio >= 0 else None,
        )
    except (ValueError, KeyError) as e:
        sys.stderr.write(f"dspark loadtest: {e}\n")
        sys.exit(2)
    environment.host = host
    environment.dspark_run = LoadRun(
        tier=tier,
        host=host,
        api_prefix="/" + o.api_prefix.strip("/"),
        api_key=o.api_key or None,
        model=o.model or None,
        seed=o.seed,
        report_prefix=o.report_prefix or o.csv_prefix or "dspark-loadtest",
    )
    log.info("tier %s against %s: %s", tier.name, host, tier.load)


@events.test_start.add_listener
def _on_test_start(environment, **_kw) -> None:
    run: LoadRun = environment.dspark_run
    run.samples.clear()
    run.started = 0
    run.aborted = None
    run.cap_reached = False
    if run.model is None:
        try:
            run.model = _discover_model(run)
        except RuntimeError as e:
            log.error("%s", e)
            run.aborted = str(e)  # the shape ends the run at its next tick; users send nothing
            return
    run.metrics_before = server_metrics.scrape(run.host)


@events.test_stop.add_listener
def _on_test_stop(environment, **_kw) -> None:
    run: LoadRun = environment.dspark_run
    if run.aborted:
        environment.process_exit_code = 2
        return
    after = server_metrics.scrape(run.host) if run.metrics_before is not None else None
    view = server_metrics.server_view(run.metrics_before, after) if after is not None else None
    samples = list(run.samples)
    report = build_report(run.tier, samples, view, run.host)
    report_path, samples_path = write_report(run.report_prefix, report, samples)
    print("\n" + report["table"], flush=True)
    if agreement := report["ttft_agreement"]:
        print(
            f"TTFT mean: client {agreement['client_mean_s']:.4f} s, server {agreement['server_mean_s']:.4f} s",
            flush=True,
        )
    print(f"report: {report_path}\nsamples: {samples_path}", flush=True)
    # Overrides Locust's own rule (exit 1 on any failed request): errors below the tier's ratio pass.
    environment.process_exit_code = 0 if report["passed"] else 1


def _discover_model(run: LoadRun) -> str:
    import requests

    try:
        r = requests.get(run.host + run.api_prefix + "/models", headers=run.headers, timeout=10)
        r.raise_for_status()
        return r.json()["data"][0]["id"]
    except (requests.RequestException, KeyError, IndexError, ValueError) as e:
        msg = f"cannot discover the model at {run.host}{run.api_prefix}/models ({e}); pass --model"
        raise RuntimeError(msg) from None


class OpenAIStreamUser(FastHttpUser):
    """Sends streaming chat / completion requests back to back (or paced) and measures each stream."""

    host = DEFAULT_HOST
    network_timeout = 300.0
    connection_timeout = 10.0

    def wait_time(self) -> float:
        return self.environment.dspark_run.seconds_between_requests

    @task
    def stream(self) -> None:
        run: LoadRun = self.environment.dspark_run
        if run.aborted or not run.admit():  # the shape ends the run at its next tick
            raise StopUser()
        api = run.pick_api()
        domain, prompt = run.sampler.sample()
        sample = RequestSample(api=api, domain=domain, start=time.time())
        sent = time.perf_counter()
        with self.client.request(
            "POST",
            run.path(api),
            json=run.request_body(api, prompt),
            headers=run.headers,
            stream=True,
            catch_response=True,
        ) as resp:
            sample.status = resp.status_code
            meter = StreamMeter(sample, sent)
            try:
                if resp.status_code == 0:  # no HTTP response at all
                    raise StreamError(f"connection failed: {getattr(resp, 'error', None) or 'no response'}")
                if resp.status_code != 200:
                    raise StreamError(f"HTTP {resp.status_code}: {(resp.content or b'')[:200]!r}")
                # Line by line: the response's own readline() splits on CRLF and read(n) waits for n
                # bytes, either of which would hold back SSE events and inflate TTFT.
                raw = resp._response
                while line := raw.readline(b"\n"):
                    meter.feed(line, time.perf_counter())
                meter.finish(time.perf_counter())
            except GreenletExit:  # the run ended mid-stream: keep what was measured, then let Locust stop us
                run.samples.append(meter.cut(time.perf_counter()))
                raise
            except Exception as e:  # transport errors and bad streams fail the request, not the user
                sample.error = str(e) or type(e).__name__
                resp.failure(sample.error)
            resp.request_meta["response_time"] = (time.perf_counter() - sent) * 1000
        run.samples.append(sample)
        if sample.ok:
            self._report(sample)

    def _report(self, s: RequestSample) -> None:
        fire = self.environment.events.request.fire

        def row(kind: str, value: float, size: int = 0) -> None:
            fire(
                request_type=kind,
                name=s.api,
                response_time=value,
                response_length=size,
                exception=None,
                context={},
            )

        if s.ttft_s is not None:
            row("TTFT", s.ttft_s * 1000, s.prompt_tokens or 0)
        if s.tpot_s is not None:
            row("TPOT", s.tpot_s * 1000, s.output_tokens)
        for gap in s.itl_s:
            row("ITL", gap * 1000)
        if s.tokens_per_s is not None:
            row("USER_TPS", s.tokens_per_s, s.output_tokens)


class TierShape(LoadTestShape):
    """Users over time from the tier's load shape; returns None at the end, which stops the run."""

    def tick(self) -> tuple[int, float] | None:
        run: LoadRun = self.runner.environment.dspark_run
        if run.aborted or run.cap_reached:
            return None
        stage = stage_at(run.plan, self.get_run_time())
        return None if stage is None else (stage.users, stage.spawn_rate)
