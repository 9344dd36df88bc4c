"""``/metrics`` in Prometheus' text format.

HTTP-side numbers (requests by endpoint and status, time to first token, request latency) are
ordinary ``prometheus_client`` metrics updated by the handlers. Engine-side numbers are read at
scrape time from the engine thread's latest :class:`~hispec_decode.serving.async_engine.Snapshot`
by a collector, so the engine loop never calls into Prometheus. Each server owns its registry
(several servers can live in one process, as in the tests).
"""

from __future__ import annotations

from typing import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from .async_engine import Snapshot

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)


def _ratio(num: int, den: int) -> float:
    return num / den if den else float("nan")


class EngineCollector:
    def __init__(self, snapshot: Callable[[], Snapshot], model: str, method: str) -> None:
        self.snapshot, self.labels = snapshot, {"model": model, "method": method}

    def _gauge(self, name: str, doc: str, value: float) -> GaugeMetricFamily:
        g = GaugeMetricFamily(name, doc, labels=list(self.labels))
        g.add_metric(list(self.labels.values()), value)
        return g

    def _counter(self, name: str, doc: str, value: float) -> CounterMetricFamily:
        c = CounterMetricFamily(name, doc, labels=list(self.labels))
        c.add_metric(list(self.labels.values()), value)
        return c

    def collect(self) -> Iterator[Metric]:
        s = self.snapshot()
        c = s.counters
        yield self._gauge("hispec_num_requests_running", "Sequences in the running batch.", s.running)
        yield self._gauge("hispec_num_requests_waiting", "Requests queued for a place in the batch.", s.waiting)
        yield self._gauge("hispec_cache_blocks_used", "KV cache blocks held by sequences.", s.blocks_used)
        yield self._gauge("hispec_cache_blocks_free", "KV cache blocks free.", s.blocks_free)
        yield self._counter("hispec_preemptions", "Sequences preempted for KV blocks (recomputed later).", s.preemptions)
        yield self._counter("hispec_aborted_requests", "Requests stopped before they finished (client gone, "
                            "shutdown).", s.aborted)
        yield self._counter("hispec_generation_tokens", "Output tokens committed by the full model.", s.generated_tokens)
        yield self._gauge("hispec_generation_tokens_per_second", "Output tokens/s over the last 10 s.",
                          s.tokens_per_second)
        yield self._counter("hispec_draft_tokens", "Drafts checked by the intermediate exit L_i.", c.drafted)
        yield self._counter("hispec_accepted_intermediate_tokens", "Drafts L_i accepted.", c.accepted_intermediate)
        yield self._counter("hispec_tentative_tokens", "Proposals verified by the full model L_f.", c.tentative)
        yield self._counter("hispec_accepted_final_tokens", "Proposals L_f accepted.", c.accepted_final)
        yield self._counter("hispec_full_passes", "Full-model passes, counted per sequence.", c.calls_full)
        yield self._gauge("hispec_acceptance_intermediate", "Share of drafts L_i accepted (NaN before any).",
                          _ratio(c.accepted_intermediate, c.drafted))
        yield self._gauge("hispec_acceptance_final", "Share of proposals L_f accepted (NaN before any).",
                          _ratio(c.accepted_final, c.tentative))
        yield from self._levels(s)

    def _levels(self, s: Snapshot) -> Iterator[Metric]:
        """Per verification level (label ``level``: L<layer>, L_v or L_f): passes, proposals checked and
        accepted there, and the acceptance."""
        labels = [*self.labels, "level"]
        families = {
            "passes": CounterMetricFamily("hispec_level_passes", "Passes that checked proposals at a level "
                                          "(plain steps count at L_f).", labels=labels),
            "checked": CounterMetricFamily("hispec_level_checked_tokens", "Proposals checked at a level.", labels=labels),
            "accepted": CounterMetricFamily("hispec_level_accepted_tokens", "Proposals a level accepted.", labels=labels),
            "acceptance": GaugeMetricFamily("hispec_level_acceptance", "Share of proposals a level accepted (NaN "
                                            "before any).", labels=labels),
        }
        c = s.counters
        for level, name in enumerate(s.levels[1:], start=1):
            values = [*self.labels.values(), name]
            checked, accepted = c.checked.get(level, 0), c.accepted.get(level, 0)
            families["passes"].add_metric(values, c.calls.get(level, 0))
            families["checked"].add_metric(values, checked)
            families["accepted"].add_metric(values, accepted)
            families["acceptance"].add_metric(values, _ratio(accepted, checked))
        yield from families.values()


class ServerMetrics:
    def __init__(self, snapshot: Callable[[], Snapshot], model: str, method: str) -> None:
        self.registry = CollectorRegistry()
        self.registry.register(EngineCollector(snapshot, model, method))
        self.requests = Counter("hispec_requests", "HTTP requests by endpoint and status code.",
                                ["endpoint", "status"], registry=self.registry)
        self.prompt_tokens = Counter("hispec_prompt_tokens", "Prompt tokens of admitted requests.", registry=self.registry)
        self.ttft = Histogram("hispec_time_to_first_token_seconds", "Request arrival to its first output text.",
                              buckets=LATENCY_BUCKETS, registry=self.registry)
        self.latency = Histogram("hispec_request_latency_seconds", "Request arrival to its last byte.",
                                 buckets=LATENCY_BUCKETS, registry=self.registry)
        self.tokens_per_full_pass = Histogram(
            "hispec_tokens_per_full_pass", "Output tokens per full-model pass, per finished request.",
            buckets=(1.0, 1.25, 1.5, 2.0, 2.5, 3.0, 4.0, 6.0, 8.0), registry=self.registry)

    def render(self) -> bytes:
        return generate_latest(self.registry)
