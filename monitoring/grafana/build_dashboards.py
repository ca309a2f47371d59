"""Build llmhost's Grafana dashboards (monitoring/grafana/dashboards/*.json).

The dashboards are code: this script describes them with Grafana's own
grafana-foundation-sdk builders and writes the JSON that Grafana provisions.
Edit this file, then run

    .venv/bin/python monitoring/grafana/build_dashboards.py

and commit the JSON with it. tests/monitoring checks that the committed JSON is
what this script writes, that it is a lossless Grafana dashboard model, and
that every query parses in a real Prometheus (and returns data on a booted host
in tests/system).

Metric names are the ones llmhost's Triton backend exports (vllm:*, label
`model`), Triton's own (nv_*), node_exporter's (node_*), the smoke probe's
(llmhost_smoke_*), a model's followers on other hosts (llmhost_follower_*, `llmhost
follow --textfile`) and NVIDIA DCGM's exporter (DCGM_FI_*, roles/dcgm_exporter). Every
target carries `instance` = the inventory host name (roles/prometheus sets it).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from grafana_foundation_sdk.builders import common as cb
from grafana_foundation_sdk.builders import dashboard as db
from grafana_foundation_sdk.builders import gauge, heatmap, piechart, prometheus, stat, statetimeline, timeseries
from grafana_foundation_sdk.cog.encoder import JSONEncoder
from grafana_foundation_sdk.cog.plugins import register_default_plugins
from grafana_foundation_sdk.models import common
from grafana_foundation_sdk.models.dashboard import (
    Dashboard,
    DashboardCursorSync,
    DataSourceRef,
    Threshold,
    ThresholdsMode,
    ValueMap,
    ValueMappingResult,
    VariableOption,
    VariableRefresh,
    VariableSort,
)
from grafana_foundation_sdk.models.heatmap import HeatmapColorMode
from grafana_foundation_sdk.models.piechart import PieChartType
from grafana_foundation_sdk.models.prometheus import PromQueryFormat

OUT_DIR = Path(__file__).resolve().parent / "dashboards"
DS = DataSourceRef(type_val="prometheus", uid="${datasource}")
TAGS = ["llmhost"]
# Selectors shared by the panels (Grafana substitutes the variables).
HOST = 'instance=~"$instance"'
SERVING = 'instance=~"$instance", model=~"$model"'
RATE = "[$__rate_interval]"
# node_exporter already leaves out overlay, proc, sysfs, ...; these add nothing.
FS = 'fstype!~"ramfs|squashfs|nsfs|autofs"'
NET = 'instance=~"$instance", device!="lo"'

ALL = VariableOption(selected=True, text=["All"], value=["$__all"])
Steps = list[tuple[float | None, str]]
GREEN: Steps = [(None, "green")]


def thresholds(steps: Steps) -> db.ThresholdsConfig:
    return (
        db.ThresholdsConfig()
        .mode(ThresholdsMode.ABSOLUTE)
        .steps([Threshold(value=v, color=c) for v, c in steps])
    )


def query(expr: str, legend: str, ref: str, fmt: PromQueryFormat | None = None,
          instant: bool = False) -> prometheus.Dataquery:
    q = prometheus.Dataquery().expr(expr).legend_format(legend).ref_id(ref).datasource(DS)
    if fmt is not None:
        q = q.format(fmt)
    return q.instant() if instant else q.range()


def targets(*specs: tuple[str, str]) -> list[prometheus.Dataquery]:
    """(expr, legend) pairs as queries A, B, C, ..."""
    return [query(e, legend, chr(ord("A") + i)) for i, (e, legend) in enumerate(specs)]


def legend_table() -> cb.VizLegendOptions:
    return (
        cb.VizLegendOptions()
        .display_mode(common.LegendDisplayMode.TABLE)
        .placement(common.LegendPlacement.BOTTOM)
        .show_legend(True)
        .calcs(["mean", "max", "lastNotNull"])
    )


def ts(title: str, desc: str, unit: str, qs: list[prometheus.Dataquery], steps: Steps = GREEN,
       *, w: int = 12, h: int = 8, min_val: float | None = 0, max_val: float | None = None,
       stack: bool = False) -> timeseries.Panel:
    p = (
        timeseries.Panel()
        .title(title)
        .description(desc)
        .datasource(DS)
        .targets(qs)
        .unit(unit)
        .thresholds(thresholds(steps))
        .span(w)
        .height(h)
        .legend(legend_table())
        .tooltip(cb.VizTooltipOptions().mode(common.TooltipDisplayMode.MULTI).sort(common.SortOrder.DESCENDING))
        .line_width(1)
        .fill_opacity(10)
        .show_points(common.VisibilityMode.NEVER)
    )
    if len(steps) > 1:
        p = p.thresholds_style(cb.GraphThresholdsStyleConfig().mode(common.GraphThresholdsStyleMode.DASHED))
    if min_val is not None:
        p = p.min(min_val)
    if max_val is not None:
        p = p.max(max_val)
    if stack:
        p = p.stacking(cb.StackingConfig().mode(common.StackingMode.NORMAL)).fill_opacity(40)
    return p


def single(title: str, desc: str, unit: str, expr: str, steps: Steps = GREEN, *, w: int = 3, h: int = 4,
           mappings: list[ValueMap] | None = None, decimals: float | None = None) -> stat.Panel:
    p = (
        stat.Panel()
        .title(title)
        .description(desc)
        .datasource(DS)
        .targets([query(expr, "", "A")])
        .unit(unit)
        .thresholds(thresholds(steps))
        .span(w)
        .height(h)
        .color_mode(common.BigValueColorMode.VALUE)
        .graph_mode(common.BigValueGraphMode.AREA)
        .reduce_options(cb.ReduceDataOptions().calcs(["lastNotNull"]).values(False))
    )
    if mappings:
        p = p.mappings(list(mappings))
    if decimals is not None:
        p = p.decimals(decimals)
    return p


def heat(title: str, desc: str, unit: str, expr: str) -> heatmap.Panel:
    return (
        heatmap.Panel()
        .title(title)
        .description(desc)
        .datasource(DS)
        .targets([query(expr, "{{le}}", "A", fmt=PromQueryFormat.HEATMAP)])
        .unit(unit)
        .thresholds(thresholds(GREEN))
        .span(12)
        .height(8)
        .calculate(False)
        .y_axis(heatmap.YAxisConfig().unit(unit))
        .cell_values(heatmap.CellValues().unit("short"))
        .color(heatmap.HeatmapColorOptions().mode(HeatmapColorMode.SCHEME).scheme("Oranges").steps(64))
    )


def quantiles(metric: str, qs: tuple[float, ...], by: str = "model") -> list[tuple[str, str]]:
    return [
        (f"histogram_quantile({q}, sum by ({by}, le) (rate({metric}_bucket{{{SERVING}}}{RATE})))",
         f"p{round(q * 100)} {{{{{by}}}}}")
        for q in qs
    ]


def datasource_var() -> db.DatasourceVariable:
    return db.DatasourceVariable("datasource").label("Data source").type("prometheus")


def instance_var() -> db.QueryVariable:
    return (
        db.QueryVariable("instance")
        .label("Host")
        .description("Inventory host name (Prometheus' instance label)")
        .datasource(DS)
        .query('label_values(up{job=~"triton|node"}, instance)')
        .refresh(VariableRefresh.ON_TIME_RANGE_CHANGED)
        .sort(VariableSort.ALPHABETICAL_ASC)
        .multi(True)
        .include_all(True)
        .all_value(".*")
        .current(ALL)
    )


def model_var() -> db.QueryVariable:
    return (
        db.QueryVariable("model")
        .label("Model")
        .description("Model name in Triton")
        .datasource(DS)
        .query('label_values(vllm:num_requests_running{instance=~"$instance"}, model)')
        .refresh(VariableRefresh.ON_TIME_RANGE_CHANGED)
        .sort(VariableSort.ALPHABETICAL_ASC)
        .multi(True)
        .include_all(True)
        .all_value(".*")
        .current(ALL)
    )


def new_dashboard(title: str, uid: str, desc: str, variables: list[Any]) -> db.Dashboard:
    d = (
        db.Dashboard(title)
        .uid(uid)
        .description(desc)
        .tags(TAGS)
        .time("now-1h", "now")
        .refresh("30s")
        .timezone("browser")
        .tooltip(DashboardCursorSync.CROSSHAIR)
        .readonly()
    )
    for v in variables:
        d = d.with_variable(v)
    return d


def add(d: db.Dashboard, rows: list[tuple[str, list[Any]]]) -> db.Dashboard:
    """Rows of panels; panel ids are assigned in order (unique per dashboard)."""
    next_id = 1
    for title, panels in rows:
        d = d.with_row(db.Row(title).id(next_id))
        next_id += 1
        for p in panels:
            d = d.with_panel(p.id(next_id))
            next_id += 1
    return d


# --- (a) LLM serving --------------------------------------------------------------------------

def serving() -> db.Dashboard:
    ok_fail = [ValueMap({"1": ValueMappingResult(text="OK", color="green"),
                         "0": ValueMappingResult(text="FAILING", color="red")})]
    server_errors = (
        f'sum(rate(vllm:request_failed_total{{{SERVING}, reason="engine_error"}}{RATE})'
        f' or rate(vllm:request_success_total{{{SERVING}, finished_reason="error"}}{RATE}))'
    )
    all_requests = (
        f"sum(rate(vllm:request_success_total{{{SERVING}}}{RATE})"
        f" or rate(vllm:request_failed_total{{{SERVING}}}{RATE}))"
    )
    overview = [
        single("Requests/s", "Finished requests per second (every finish reason).", "reqps",
               f"sum(rate(vllm:request_success_total{{{SERVING}}}{RATE}))"),
        single("Server error ratio", "Engine errors and requests finished with reason error, over all requests "
               "(invalid requests are the client's; see Failed requests). Alert: LLMHostErrorRatioHigh at 5%.",
               "percentunit", f"({server_errors} / {all_requests}) or vector(0)",
               [(None, "green"), (0.01, "orange"), (0.05, "red")], decimals=2),
        single("TTFT p99", "99th percentile time to first token. Alert: LLMHostTTFTHigh above 5 s.", "s",
               "histogram_quantile(0.99, sum by (le) "
               f"(rate(vllm:time_to_first_token_seconds_bucket{{{SERVING}}}{RATE})))",
               [(None, "green"), (1, "orange"), (5, "red")]),
        single("Output tokens/s", "Generated tokens per second.", "suffix: tok/s",
               f"sum(rate(vllm:generation_tokens_total{{{SERVING}}}{RATE}))"),
        single("Running", "Requests in vLLM's running batch now.", "short",
               f"sum(vllm:num_requests_running{{{SERVING}}})"),
        single("Waiting", "Requests in vLLM's waiting queue now. Alert: LLMHostQueueGrowing.", "short",
               f"sum(vllm:num_requests_waiting{{{SERVING}}})", [(None, "green"), (1, "orange"), (10, "red")]),
        gauge.Panel()
        .title("KV-cache use")
        .description("Largest KV-cache use among the selected models. Alert: LLMHostKVCacheNearFull above 95%.")
        .datasource(DS)
        .targets([query(f"max(vllm:kv_cache_usage_perc{{{SERVING}}})", "", "A")])
        .unit("percentunit")
        .min(0)
        .max(1)
        .thresholds(thresholds([(None, "green"), (0.8, "orange"), (0.95, "red")]))
        .span(3)
        .height(4)
        .reduce_options(cb.ReduceDataOptions().calcs(["lastNotNull"]).values(False)),
        single("Smoke probe", "Last result of the llmhost-smoke@MODEL timer (all checks). "
               "Alert: LLMHostSmokeProbeFailing.", "none",
               f"min(llmhost_smoke_success{{{SERVING}}})", [(None, "red"), (1, "green")], mappings=ok_fail),
    ]
    traffic = [
        ts("Requests/s by finish reason", "Finished requests per second by model and vLLM finish reason.", "reqps",
           targets((f"sum by (model, finished_reason) (rate(vllm:request_success_total{{{SERVING}}}{RATE}))",
                    "{{model}} {{finished_reason}}")), stack=True),
        ts("Failed requests/s by reason",
           "Requests answered with an error: invalid_request (client), engine_error (server), "
           "shutting_down (during a drain).", "reqps",
           targets((f"sum by (model, reason) (rate(vllm:request_failed_total{{{SERVING}}}{RATE}))",
                    "{{model}} {{reason}}")), [(None, "green"), (0.1, "red")]),
        ts("Server error ratio", "Engine errors and requests finished with reason error over all requests.",
           "percentunit",
           targets((f"sum by (model) (rate(vllm:request_failed_total{{{SERVING}, reason=\"engine_error\"}}{RATE})"
                    f" or rate(vllm:request_success_total{{{SERVING}, finished_reason=\"error\"}}{RATE}))"
                    f" / sum by (model) (rate(vllm:request_success_total{{{SERVING}}}{RATE})"
                    f" or rate(vllm:request_failed_total{{{SERVING}}}{RATE}))", "{{model}}")),
           [(None, "green"), (0.01, "orange"), (0.05, "red")], max_val=None),
        ts("Cancelled requests/s", "Requests aborted because the client cancelled or disconnected.", "reqps",
           targets((f"sum by (model) (rate(vllm:request_cancelled_total{{{SERVING}}}{RATE}))", "{{model}}"))),
        piechart.Panel()
        .title("Finish reasons")
        .description("Finished requests by finish reason over the dashboard's time range.")
        .datasource(DS)
        .targets([query(f"sum by (finished_reason) (increase(vllm:request_success_total{{{SERVING}}}[$__range]))",
                        "{{finished_reason}}", "A", instant=True)])
        .unit("short")
        .thresholds(thresholds(GREEN))
        .pie_type(PieChartType.DONUT)
        .reduce_options(cb.ReduceDataOptions().calcs(["lastNotNull"]).values(False))
        .legend(piechart.PieChartLegendOptions().display_mode(common.LegendDisplayMode.TABLE)
                .placement(common.LegendPlacement.RIGHT).show_legend(True).values(["value", "percent"]))
        .span(12)
        .height(8),
        ts("Preemptions/s", "Requests preempted by vLLM's scheduler (KV cache full).", "ops",
           targets((f"sum by (model) (rate(vllm:num_preemptions_total{{{SERVING}}}{RATE}))", "{{model}}")),
           [(None, "green"), (0.1, "orange")]),
    ]
    latency = [
        ts("End-to-end latency", "Request latency inside the engine, p50/p90/p99.", "s",
           targets(*quantiles("vllm:e2e_request_latency_seconds", (0.5, 0.9, 0.99)))),
        ts("Time to first token", "TTFT p50/p99 (Alert: LLMHostTTFTHigh, p99 above 5 s).", "s",
           targets(*quantiles("vllm:time_to_first_token_seconds", (0.5, 0.99))),
           [(None, "green"), (1, "orange"), (5, "red")]),
        ts("Inter-token latency", "Time between output tokens, p50/p99.", "s",
           targets(*quantiles("vllm:inter_token_latency_seconds", (0.5, 0.99))),
           [(None, "green"), (0.1, "orange"), (0.5, "red")]),
        ts("Queue, prefill and decode time", "Mean time a request spent waiting, in prefill and in decode.", "s",
           targets(*[(f"sum by (model) (rate(vllm:request_{p}_time_seconds_sum{{{SERVING}}}{RATE}))"
                      f" / sum by (model) (rate(vllm:request_{p}_time_seconds_count{{{SERVING}}}{RATE}))",
                      f"{p} {{{{model}}}}") for p in ("queue", "prefill", "decode")])),
    ]
    load = [
        ts("Tokens/s", "Prompt tokens processed and output tokens generated per second.", "suffix: tok/s",
           targets((f"sum by (model) (rate(vllm:generation_tokens_total{{{SERVING}}}{RATE}))", "output {{model}}"),
                   (f"sum by (model) (rate(vllm:prompt_tokens_total{{{SERVING}}}{RATE}))", "prompt {{model}}"))),
        ts("Running and waiting requests", "vLLM scheduler: requests in the running batch and in the queue.", "short",
           targets((f"sum by (model) (vllm:num_requests_running{{{SERVING}}})", "running {{model}}"),
                   (f"sum by (model) (vllm:num_requests_waiting{{{SERVING}}})", "waiting {{model}}"))),
        ts("KV-cache use", "Share of vLLM's KV cache in use (Alert: LLMHostKVCacheNearFull above 95%).",
           "percentunit",
           targets((f"max by (instance, model) (vllm:kv_cache_usage_perc{{{SERVING}}})", "{{instance}} {{model}}")),
           [(None, "green"), (0.8, "orange"), (0.95, "red")], max_val=1),
        ts("Smoke probe checks", "Each check of the last smoke probe run: 1 passed, 0 failed.", "none",
           targets((f"min by (model, check) (llmhost_smoke_check_success{{{SERVING}}})", "{{model}} {{check}}"),
                   ), [(None, "red"), (1, "green")], max_val=1),
    ]
    lengths = [
        heat("Prompt length", "Prompt tokens of finished requests.", "short",
             f"sum by (le) (increase(vllm:request_prompt_tokens_bucket{{{SERVING}}}{RATE}))"),
        heat("Generation length", "Output tokens of finished requests.", "short",
             f"sum by (le) (increase(vllm:request_generation_tokens_bucket{{{SERVING}}}{RATE}))"),
    ]
    # The llmhost gateway (roles/gateway, job gateway): what clients of the OpenAI API see.
    gw_quantiles = [
        (f"histogram_quantile({q}, sum by (le) (rate(llmhost_gateway_{metric}_bucket{{{SERVING}}}{RATE})))",
         f"p{round(q * 100)} {name}")
        for metric, name in (("request_duration_seconds", "latency"), ("time_to_first_token_seconds", "TTFT"))
        for q in (0.5, 0.95)
    ]
    gateway = [
        ts("Gateway requests/s by status", "Responses of the llmhost gateway by HTTP status (401: no or a wrong "
           "key, 429: a key's limit, 5xx: upstream or gateway errors; Alert: LLMHostGatewayErrorRatioHigh).",
           "reqps",
           targets((f"sum by (status) (rate(llmhost_gateway_requests_total{{{SERVING}}}{RATE}))", "{{status}}")),
           stack=True),
        ts("Gateway latency and TTFT", "p50 and p95 of the whole request and of the time to the first token, "
           "as the gateway's clients see them.", "s", targets(*gw_quantiles)),
        ts("Rate-limited requests/s", "Requests refused with 429 by key and by the limit they hit "
           "(rpm, tpm, max_concurrent).", "reqps",
           targets((f"sum by (key, limit) (rate(llmhost_gateway_rate_limited_total{{{HOST}}}{RATE}))",
                    "{{key}} {{limit}}")), [(None, "green"), (0.1, "orange")]),
        ts("Gateway upstreams up", "Each Triton upstream of the gateway: 1 healthy, 0 down "
           "(Alert: LLMHostGatewayNoHealthyUpstream when all are down).", "none",
           targets((f"min by (instance, upstream) (llmhost_gateway_upstream_up{{{HOST}}})",
                    "{{instance}} {{upstream}}")), [(None, "red"), (1, "green")], max_val=1),
        ts("Gateway upstreams by state", "Upstreams in service, draining (they said they are stopping) and out "
           "(failed checks or a request that could not reach them), summed over the gateways; and requests "
           "sent to an upstream out of service because none was in service for their model (panic mode).",
           "short",
           targets((f"sum by (state) (llmhost_gateway_upstream_state{{{HOST}}})", "{{state}}"),
                   (f"sum(rate(llmhost_gateway_panic_routed_total{{{HOST}}}{RATE}))", "panic-routed req/s"))),
    ]
    # A model's replicas (engines: model instances on a host, and hosts) and how the gateway
    # spreads requests over them (llmhost.gateway.routing; docs/api.md#replicas-and-routing).
    prefix_hits = "sum by ({by}) (rate(vllm:prefix_cache_hits_total{{{sel}}}{r}))"
    prefix_queries = "sum by ({by}) (rate(vllm:prefix_cache_queries_total{{{sel}}}{r}))"
    routing = [
        ts("Prefix-cache hit rate per replica", "Share of prompt tokens found in vLLM's prefix cache, per engine "
           "(host and Triton model instance) and for each model's whole fleet (hits over queries summed over its "
           "engines). Cache-aware routing (gateway_routing) sends requests that share a prompt's start to the "
           "same engine, so that it computes the prefix once.", "percentunit",
           targets(*[(f"{prefix_hits.format(by=by, sel=SERVING, r=RATE)}"
                      f" / {prefix_queries.format(by=by, sel=SERVING, r=RATE)}", legend)
                     for by, legend in (("instance, model, model_instance", "{{instance}} {{model_instance}}"),
                                        ("model", "fleet {{model}}"))]),
           max_val=1),
        ts("Routing decisions by reason", "Requests the gateway routed to a replica per second, by the decision's "
           "reason: prefix or session (the routing key's replica), load_bound (that one was over its load bound: "
           "the next in the key's order took it), no_key (nothing to key on: the least loaded), least_loaded, "
           "round_robin (the model's policy).", "reqps",
           targets((f"sum by (model, reason) (rate(llmhost_gateway_routing_decisions_total{{{SERVING}}}{RATE}))",
                    "{{model}} {{reason}}")), stack=True),
    ]
    # Where a stream's time goes between the engine and the client (docs/performance.md):
    # each engine step should reach the client as its own event.
    streaming = [
        ts("Tokens per streamed event", "Output tokens of one completion in each response the gateway streams "
           "(p50, p99): 1 when every engine step reaches the client as its own event; more means steps were "
           "bunched on the way.", "short",
           targets(*[(f"histogram_quantile({q}, sum by (le) (rate(llmhost_gateway_tokens_per_event_bucket"
                      f"{{{SERVING}}}{RATE})))", f"p{round(q * 100)}") for q in (0.5, 0.99)]),
           [(None, "green"), (1.5, "orange"), (3, "red")], w=8),
        ts("Backend response delay", "From an engine output to its response leaving the backend (handed to "
           "tritonserver, or written to the engine socket), p50/p99.", "s",
           targets(*quantiles("llmhost:response_delay_seconds", (0.5, 0.99))),
           [(None, "green"), (0.005, "orange"), (0.05, "red")], w=8),
        ts("Engine socket to gateway", "From the backend writing a response on the engine socket to the gateway "
           "reading it (streams of the gateway on the inference host), p50/p99.", "s",
           targets(*[(f"histogram_quantile({q}, sum by (le) (rate(llmhost_gateway_upstream_transit_seconds_bucket"
                      f"{{{SERVING}}}{RATE})))", f"p{round(q * 100)}") for q in (0.5, 0.99)]),
           [(None, "green"), (0.005, "orange"), (0.05, "red")], w=8),
    ]
    # A model spread over several hosts (llmhost.multinode, docs/gpu.md): the head serves it in
    # Triton, each follower host's `llmhost follow --textfile` reports through node_exporter.
    head = ("The head host serves the model in Triton (the panels above, under its host name); each follower "
            "host runs llmhost follow, whose workers join the head's engine, and has a row here per model.")
    across_hosts = [
        statetimeline.Panel()
        .title("Followers joined")
        .description("Per model and follower host (instance): joined (1) while the follower's workers are joined "
                     "to the head's engine, not joined (0) otherwise; the model is served only while all its "
                     "followers are joined (Alert: LLMHostFollowerNotJoined after 10 minutes). " + head
                     + " Empty where no model spans hosts.")
        .datasource(DS)
        .targets(targets((f"min by (model, instance) (llmhost_follower_joined{{{SERVING}}})",
                          "{{model}} on {{instance}}")))
        .unit("none")
        .thresholds(thresholds([(None, "red"), (1, "green")]))
        .mappings([ValueMap({"1": ValueMappingResult(text="joined", color="green"),
                             "0": ValueMappingResult(text="not joined", color="red")})])
        .show_value(common.VisibilityMode.AUTO)
        .merge_values(True)
        .span(12)
        .height(8),
        ts("Since each follower's last check", "Seconds since each follower (per model and follower host) last "
           "checked its head: llmhost follow rewrites its state at least every 15 s while it runs, so a growing "
           "age means it is not running (Alert: LLMHostFollowerStale above 120 s). " + head
           + " A follower host that is down has no data (Alert: LLMHostTargetDown).", "s",
           targets((f"max by (model, instance) (time() - llmhost_follower_last_check_timestamp_seconds"
                    f"{{{SERVING}}})", "{{model}} on {{instance}}")),
           [(None, "green"), (60, "orange"), (120, "red")]),
    ]
    d = new_dashboard(
        "llmhost / LLM serving", "llmhost-serving",
        "Requests, latency, throughput and scheduler state of the models served by llmhost "
        "(vLLM inside Triton, metrics from Triton's /metrics).",
        [datasource_var(), instance_var(), model_var()],
    )
    return add(d, [("Overview", overview), ("Requests", traffic), ("Latency", latency),
                   ("Throughput and load", load), ("Request lengths", lengths), ("Gateway", gateway),
                   ("Replicas and routing", routing), ("Streaming path", streaming),
                   ("Models across hosts", across_hosts)])


# --- (b) Triton ---------------------------------------------------------------------------------

def triton() -> db.Dashboard:
    per_request = (
        "sum by (model) (rate(nv_inference_{m}_duration_us{{{sel}}}{r}))"
        " / sum by (model) (rate(nv_inference_request_success{{{sel}}}{r}))"
    )
    panels = [
        ts("Inference requests/s", "Successful inference requests (Triton counts one per request, "
           "also for decoupled streams).", "reqps",
           targets((f"sum by (model) (rate(nv_inference_request_success{{{SERVING}}}{RATE}))", "{{model}}"))),
        ts("Failed inference requests/s", "Triton's failure counter by reason (REJECTED, CANCELED, BACKEND, OTHER).",
           "reqps",
           targets((f"sum by (model, reason) (rate(nv_inference_request_failure{{{SERVING}}}{RATE}))",
                    "{{model}} {{reason}}")), [(None, "green"), (0.1, "red")]),
        ts("Inferences and executions/s", "Inferences (batch items) and model executions per second.", "ops",
           targets((f"sum by (model) (rate(nv_inference_count{{{SERVING}}}{RATE}))", "inferences {{model}}"),
                   (f"sum by (model) (rate(nv_inference_exec_count{{{SERVING}}}{RATE}))", "executions {{model}}"))),
        ts("Pending requests", "Requests received by Triton and not yet handed to the backend.", "short",
           targets((f"sum by (model) (nv_inference_pending_request_count{{{SERVING}}})", "{{model}}")),
           [(None, "green"), (10, "orange")]),
        ts("Queue time per request", "Mean time requests wait in Triton's scheduler queue.", "µs",
           targets((per_request.format(m="queue", sel=SERVING, r=RATE), "{{model}}")),
           [(None, "green"), (100000, "orange")]),
        ts("Compute time per request", "Mean time in input handling, in the backend's execute() and in output "
           "handling. For decoupled models (ours) execute() returns at once: latency is on the LLM dashboard.",
           "µs",
           targets(*[(per_request.format(m=f"compute_{p}", sel=SERVING, r=RATE), f"{p} {{{{model}}}}")
                     for p in ("input", "infer", "output")])),
        ts("Request duration per request", "Mean request duration as Triton measures it (misleading for "
           "decoupled models, server#8463).", "µs",
           targets((per_request.format(m="request", sel=SERVING, r=RATE), "{{model}}"))),
        ts("Triton host CPU and memory", "CPU utilisation and memory use of the host as Triton reports them.",
           "percentunit",
           targets((f"max by (instance) (nv_cpu_utilization{{{HOST}}})", "CPU {{instance}}"),
                   (f"max by (instance) (nv_cpu_memory_used_bytes{{{HOST}}} / nv_cpu_memory_total_bytes{{{HOST}}})",
                    "memory {{instance}}")),
           [(None, "green"), (0.9, "red")], max_val=1),
    ]
    d = new_dashboard(
        "llmhost / Triton", "llmhost-triton",
        "Triton Inference Server's own metrics for the models it serves.",
        [datasource_var(), instance_var(), model_var()],
    )
    return add(d, [("Triton", panels)])


# --- (c) Host and GPU ---------------------------------------------------------------------------

def host() -> db.Dashboard:
    gpu_note = " Empty on hosts without an NVIDIA GPU."
    dcgm = " From NVIDIA DCGM's exporter (roles/dcgm_exporter)."
    host_panels = [
        ts("CPU busy", "Share of CPU time not idle, per host.", "percentunit",
           targets((f"1 - avg by (instance) (rate(node_cpu_seconds_total{{{HOST}, mode=\"idle\"}}{RATE}))",
                    "{{instance}}")), [(None, "green"), (0.8, "orange"), (0.95, "red")], max_val=1),
        ts("Load average", "1-minute load average per host.", "short",
           targets((f"node_load1{{{HOST}}}", "{{instance}} 1m"), (f"node_load15{{{HOST}}}", "{{instance}} 15m"))),
        ts("Memory used", "Memory in use (total minus available), per host.", "bytes",
           targets((f"node_memory_MemTotal_bytes{{{HOST}}} - node_memory_MemAvailable_bytes{{{HOST}}}",
                    "used {{instance}}"),
                   (f"node_memory_MemTotal_bytes{{{HOST}}}", "total {{instance}}"))),
        ts("Disk space used", "Share of each filesystem in use (Alerts: LLMHostDiskFillingUp, "
           "LLMHostDiskAlmostFull).", "percentunit",
           targets((f"1 - node_filesystem_avail_bytes{{{HOST}, {FS}}} / node_filesystem_size_bytes{{{HOST}, {FS}}}",
                    "{{instance}} {{mountpoint}}")), [(None, "green"), (0.8, "orange"), (0.95, "red")], max_val=1),
        ts("Disk I/O", "Bytes read and written per second, per device.", "Bps",
           targets((f"sum by (instance, device) (rate(node_disk_read_bytes_total{{{HOST}}}{RATE}))",
                    "read {{instance}} {{device}}"),
                   (f"sum by (instance, device) (rate(node_disk_written_bytes_total{{{HOST}}}{RATE}))",
                    "written {{instance}} {{device}}"))),
        ts("Network", "Bytes received and sent per second, per interface (loopback left out).", "Bps",
           targets(*[(f"sum by (instance, device) (rate(node_network_{d}_bytes_total{{{NET}}}{RATE}))",
                      f"{d} {{{{instance}}}} {{{{device}}}}") for d in ("receive", "transmit")])),
    ]
    gpu_panels = [
        ts("GPU utilisation", "Share of time a kernel ran, per GPU (Triton's nv_gpu_utilization)." + gpu_note,
           "percentunit", targets((f"nv_gpu_utilization{{{HOST}}}", "{{instance}} {{gpu_uuid}}")),
           [(None, "green"), (0.9, "orange")], max_val=1),
        ts("GPU memory used", "Used over total memory per GPU (Alert: LLMHostGPUMemoryNearFull above 98%; vLLM "
           "reserves gpu_memory_utilization of it)." + gpu_note, "percentunit",
           targets((f"nv_gpu_memory_used_bytes{{{HOST}}} / nv_gpu_memory_total_bytes{{{HOST}}}",
                    "{{instance}} {{gpu_uuid}}")), [(None, "green"), (0.95, "orange"), (0.98, "red")], max_val=1),
        ts("GPU power", "Power draw and limit per GPU." + gpu_note, "watt",
           targets((f"nv_gpu_power_usage{{{HOST}}}", "draw {{instance}} {{gpu_uuid}}"),
                   (f"nv_gpu_power_limit{{{HOST}}}", "limit {{instance}} {{gpu_uuid}}"))),
        ts("GPU temperature", "GPU and memory (HBM) temperature per GPU from NVIDIA DCGM's exporter "
           "(roles/dcgm_exporter; Triton exports none). Alert: LLMHostGPUTemperatureHigh above 85 C." + gpu_note,
           "celsius", targets((f"DCGM_FI_DEV_GPU_TEMP{{{HOST}}}", "GPU {{instance}} {{gpu}}"),
                              (f"DCGM_FI_DEV_MEMORY_TEMP{{{HOST}}}", "memory {{instance}} {{gpu}}")),
           [(None, "green"), (80, "orange"), (90, "red")]),
        ts("GPU clocks", "SM and memory clocks per GPU; SM clocks falling under load mean throttling."
           + dcgm + gpu_note,
           "hertz", targets((f"DCGM_FI_DEV_SM_CLOCK{{{HOST}}} * 1e6", "SM {{instance}} {{gpu}}"),
                            (f"DCGM_FI_DEV_MEM_CLOCK{{{HOST}}} * 1e6", "memory {{instance}} {{gpu}}"))),
        ts("GPU throttling", "Share of time each GPU was slowed down for heat or for its power limit (Alert: "
           "LLMHostGPUThermalThrottling above 10%)." + dcgm + gpu_note, "percentunit",
           targets((f"rate(DCGM_FI_DEV_THERMAL_VIOLATION{{{HOST}}}{RATE}) / 1e6", "thermal {{instance}} {{gpu}}"),
                   (f"rate(DCGM_FI_DEV_POWER_VIOLATION{{{HOST}}}{RATE}) / 1e6", "power {{instance}} {{gpu}}")),
           [(None, "green"), (0.1, "orange")], max_val=1),
        ts("GPU XID errors", "The code of each GPU's last XID error (0: none since the driver loaded); look codes "
           "up in NVIDIA's XID catalogue (Alert: LLMHostGPUXidError)." + dcgm + gpu_note, "none",
           targets((f"DCGM_FI_DEV_XID_ERRORS{{{HOST}}}", "{{instance}} GPU {{gpu}}")),
           [(None, "green"), (1, "red")]),
        ts("GPU memory errors", "ECC errors in the last hour (single-bit corrected, double-bit not), remapped rows "
           "and failed remaps per GPU (Alert: LLMHostGPUUncorrectableMemoryErrors)." + dcgm + gpu_note, "short",
           targets((f"increase(DCGM_FI_DEV_ECC_SBE_VOL_TOTAL{{{HOST}}}[1h])", "ECC single-bit {{instance}} {{gpu}}"),
                   (f"increase(DCGM_FI_DEV_ECC_DBE_VOL_TOTAL{{{HOST}}}[1h])", "ECC double-bit {{instance}} {{gpu}}"),
                   (f"DCGM_FI_DEV_CORRECTABLE_REMAPPED_ROWS{{{HOST}}} + "
                    f"DCGM_FI_DEV_UNCORRECTABLE_REMAPPED_ROWS{{{HOST}}}", "remapped rows {{instance}} {{gpu}}"),
                   (f"DCGM_FI_DEV_ROW_REMAP_FAILURE{{{HOST}}}", "remap failed {{instance}} {{gpu}}")),
           [(None, "green"), (1, "red")]),
        ts("GPU link errors", "PCIe replays and NVLink CRC errors per second per GPU: a growing rate points at a "
           "bad riser, cable or NVLink." + dcgm + gpu_note, "short",
           targets((f"rate(DCGM_FI_DEV_PCIE_REPLAY_COUNTER{{{HOST}}}{RATE})", "PCIe replays {{instance}} {{gpu}}"),
                   (f"rate(DCGM_FI_DEV_NVLINK_CRC_FLIT_ERROR_COUNT_TOTAL{{{HOST}}}{RATE}) + "
                    f"rate(DCGM_FI_DEV_NVLINK_CRC_DATA_ERROR_COUNT_TOTAL{{{HOST}}}{RATE})",
                    "NVLink CRC {{instance}} {{gpu}}"))),
        ts("GPU energy", "Energy use per GPU as power averaged from Triton's energy counter (joules)." + gpu_note,
           "watt", targets((f"rate(nv_energy_consumption{{{HOST}}}{RATE})", "{{instance}} {{gpu_uuid}}"))),
    ]
    d = new_dashboard(
        "llmhost / Host and GPU", "llmhost-host",
        "node_exporter's host metrics; the GPUs' utilisation, memory, power, temperature, clocks, throttling and "
        "errors (XID, ECC, PCIe, NVLink).",
        [datasource_var(), instance_var()],
    )
    return add(d, [("Host", host_panels), ("GPU", gpu_panels)])


DASHBOARDS = {"llmhost-serving.json": serving, "llmhost-triton.json": triton, "llmhost-host.json": host}


def normalise(model: Dashboard) -> dict[str, Any]:
    """The dashboard as JSON after a round trip through the SDK's model (a fixed point)."""
    once = json.loads(json.dumps(model, cls=JSONEncoder))
    return dict(json.loads(json.dumps(Dashboard.from_json(once), cls=JSONEncoder)))


def render_all() -> dict[str, str]:
    register_default_plugins()
    return {name: json.dumps(normalise(build().build()), indent=2, sort_keys=True, ensure_ascii=False) + "\n"
            for name, build in DASHBOARDS.items()}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, default=OUT_DIR, help="directory to write the JSON to")
    ap.add_argument("--check", action="store_true", help="exit 1 if the files in --out differ")
    args = ap.parse_args(argv)
    stale = []
    for name, text in render_all().items():
        path = args.out / name
        if args.check:
            if not path.exists() or path.read_text() != text:
                stale.append(str(path))
            continue
        args.out.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    if stale:
        print("out of date (run monitoring/grafana/build_dashboards.py): " + ", ".join(stale), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
