"""lab/gpu_speed.py's per-thread CPU and scheduler-gauge sampling (pure parts), the
rotation of the measured sides, the servers' command lines (the same engine arguments on
every side; the uvloop side's environment), the engine-config and GPU-sample readers, and
the backend's event-loop experiment switch (LLMHOST_EVENT_LOOP)."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from pathlib import Path

import pytest

from lab.gpucheck import speed as gpu_speed
from llmhost.backend import engine


def test_task_stat_and_schedstat_parsing():
    # comm may hold spaces and parentheses: the last ')' ends it.
    # A real line (fields 14-15 utime, stime; 39 the CPU it last ran on), the comm made harder.
    line = ("4242 (lh-engine (x)) S 1 2 3 0 -1 4194560 100 0 0 0 250 50 0 0 20 0 30 0 99 0 0 "
            "18446744073709551615 0 0 0 0 0 0 0 0 0 0 0 0 17 11 0 0 0 0 0")
    assert gpu_speed.parse_task_stat(line) == ("lh-engine (x)", 300, 11)
    assert gpu_speed.parse_schedstat("1500000000 250000000 4321\n") == (1_500_000_000, 250_000_000, 4321)


def test_metric_sum_adds_label_sets_and_ignores_look_alikes():
    text = ("# HELP vllm:num_requests_running Requests.\n# TYPE vllm:num_requests_running gauge\n"
            'vllm:num_requests_running{engine="0",model_name="llm"} 16.0\n'
            'vllm:num_requests_running{model="llm",version="1"} 3\n'
            "vllm:num_requests_running_total 99\nvllm:num_requests_waiting 2\n")
    assert gpu_speed.metric_sum(text, "vllm:num_requests_running") == 19.0
    assert gpu_speed.metric_sum(text, "vllm:num_requests_waiting") == 2.0
    assert gpu_speed.metric_sum(text, "vllm:kv_cache_usage_perc") is None


def test_thread_level_takes_the_first_and_last_sample_of_the_window():
    def snap(run_engine, run_io, extra=None):
        s = {(1, 10): ("stub", "lh-engine", 0, run_engine, run_engine // 10, run_engine // 1_000_000,
                       run_engine // 1_000_000_000),
             (1, 11): ("stub", "lh-triton-io-0", 0, run_io, 0, 100, 5),
             (2, 20): ("VLLM::EngineCore", "VLLM::EngineCor", 0, 0, 0, 0, 6)}
        return {**s, **(extra or {})}

    samples = [(0.5, snap(0, 0)),  # before the window: ignored
               (1.0, snap(1_000_000_000, 0)),
               (2.0, snap(1_500_000_000, 100_000_000)),
               (3.0, snap(2_000_000_000, 200_000_000, {(1, 12): ("stub", "T-3 (_run)", 0, 50_000_000, 0, 7, 3)})),
               (9.0, snap(9_000_000_000, 0))]  # after it: ignored
    lv = gpu_speed.thread_level(samples, 0.9, 3.5, tokens_per_s=1000.0)
    assert lv["window_s"] == 2.0 and lv["samples"] == 3
    by = {g["comm"]: g for g in lv["by_comm"]}
    assert by["lh-engine"]["cores"] == 0.5 and by["lh-engine"]["runq_wait_cores"] == 0.05
    assert by["lh-triton-io-0"]["cores"] == 0.1 and by["lh-triton-io-0"]["slices_per_s"] == 0.0
    assert by["T-3 (_run)"]["cores"] == 0.025  # started inside the window: counted from zero
    assert "VLLM::EngineCor" not in by  # idle threads are left out of by_comm
    stub = lv["by_process"]["stub"]
    assert stub["cores"] == pytest.approx(0.625) and stub["threads"] == 3
    assert stub["cpu_ms_per_token"] == pytest.approx(0.625)
    assert lv["by_process"]["VLLM::EngineCore"]["cores"] == 0.0
    assert [t["comm"] for t in lv["top_threads"]][:2] == ["lh-engine", "lh-triton-io-0"]
    assert lv["top_threads"][0]["cpus_seen"] == [1, 2] and lv["top_threads"][1]["cpus_seen"] == [5]
    assert gpu_speed.thread_level(samples, 10, 11) == {}


def test_metric_sample_and_gauge_level():
    page = ('vllm:num_requests_running{engine="0",model_name="llm"} 16.0\n'
            'vllm:num_requests_waiting{engine="0",model_name="llm"} 0.0\n'
            'vllm:inter_token_latency_seconds_sum{engine="0",model_name="llm"} 3.0\n'
            'vllm:inter_token_latency_seconds_count{engine="0",model_name="llm"} 1000.0\n'
            'vllm:inter_token_latency_seconds_bucket{engine="0",le="0.01",model_name="llm"} 1000.0\n'
            'vllm:generation_tokens_total{engine="0",model_name="llm"} 5000.0\n'
            'nv_inference_queue_duration_us{model="llm",version="1"} 700\n')
    assert gpu_speed.metric_sample(page) == {"running": 16.0, "waiting": 0.0, "itl_sum": 3.0, "itl_count": 1000.0,
                                             "generation_tokens": 5000.0, "triton_queue_us": 700.0}

    def m(running, itl_sum, itl_n, tokens, queue_us, requests, executions):
        return {"running": running, "waiting": 0.0, "itl_sum": itl_sum, "itl_count": itl_n,
                "generation_tokens": tokens, "triton_queue_us": queue_us, "triton_requests": requests,
                "triton_executions": executions}

    samples = [(0.0, m(1, 0, 0, 0, 0, 0, 0)),
               (1.0, m(16, 3.0, 1000, 5000, 700, 10, 10)),
               (1.5, {"waiting": 2.0}),  # a page without the running gauge: left out of the gauge's figures
               (3.0, m(14, 9.0, 3000, 13000, 2700, 30, 20)),
               (5.0, m(99, 99, 9999, 99999, 9999, 99, 99))]
    assert gpu_speed.gauge_level(samples, 0.5, 3.5) == {
        "samples": 2, "running_mean": 15.0, "running_max": 16, "running_min": 14, "waiting_mean": 0.7,
        "waiting_max": 2.0, "itl_ms": 3.0, "itl_n": 2000, "generation_tokens_per_s": 4000.0,
        "triton_queue_us_per_s": 1000.0, "triton_requests_per_s": 10.0, "triton_executions_per_s": 5.0,
        "triton_queue_ms": 0.1, "requests_per_execute": 2.0, "window_s": 2.0}
    assert gpu_speed.gauge_level(samples, 10, 11) == {"samples": 0}


def test_sides_rotate_so_each_goes_first_once():
    assert [gpu_speed.order(r) for r in range(3)] == [["triton", "vllm"], ["vllm", "triton"], ["triton", "vllm"]]
    three = ["triton", "vllm", "uvloop"]
    assert [gpu_speed.order(r, three) for r in range(3)] == [
        ["triton", "vllm", "uvloop"], ["vllm", "uvloop", "triton"], ["uvloop", "triton", "vllm"]]


def test_the_uvloop_side_is_the_per_step_path_with_one_env_var():
    engine_args = {"served_model_name": "llm", "max_model_len": 4096}
    cmds = {s: gpu_speed.Server(s, Path("/m"), Path("/w"), Path("/l"), engine_args, {}).command()
            for s in ("triton", "uvloop")}
    strip = {"--http-port", "--grpc-port", "--metrics-port", "--workdir"}
    def rest(cmd):
        return [a for i, a in enumerate(cmd) if a not in strip and (i == 0 or cmd[i - 1] not in strip)]
    assert rest(cmds["triton"]) == rest(cmds["uvloop"])
    assert "stream_interval_ms=0" in cmds["uvloop"]
    assert gpu_speed.SIDE_ENV == {"uvloop": {"LLMHOST_EVENT_LOOP": "uvloop"}}
    up = gpu_speed.Server("uvloop", Path("/m"), Path("/w"), Path("/l"), engine_args, {})
    assert up.metrics_url == "http://127.0.0.1:18632/metrics"
    assert gpu_speed.Server("vllm", Path("/m"), Path("/w"), Path("/l"), {}, {}).metrics_url == \
        "http://127.0.0.1:18620/metrics"


def test_thread_names_module_names_os_threads(tmp_path):
    (tmp_path / "lh_threadnames.py").write_text(gpu_speed.THREAD_NAMES_MODULE)
    code = ("import lh_threadnames, threading\n"
            "def show():\n    print(open('/proc/thread-self/comm').read().strip())\n"
            "for n in ('llmhost-triton-io-1', 'ThreadPoolExecutor-0_3', 'Thread-7 (_run)'):\n"
            "    t = threading.Thread(target=show, name=n); t.start(); t.join()\n")
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, check=True)
    assert out.stdout.split("\n")[:3] == ["lh-triton-io-1", "TPE-0_3", "T-7 (_run)"]


def test_event_loop_switch(monkeypatch):
    monkeypatch.delenv(engine.EVENT_LOOP_ENV, raising=False)
    loop = engine.new_event_loop()
    assert type(loop).__module__.startswith("asyncio")
    loop.close()
    uvloop = pytest.importorskip("uvloop")
    monkeypatch.setenv(engine.EVENT_LOOP_ENV, "uvloop")
    loop = engine.new_event_loop()
    assert isinstance(loop, uvloop.Loop)
    assert loop.run_until_complete(asyncio.sleep(0, "ok")) == "ok"
    loop.close()
    with pytest.raises(engine.EngineStartError, match="expected 'asyncio' or 'uvloop'"):
        engine.new_event_loop("trio")


def test_the_variant_side_adds_its_backend_settings_to_the_per_step_path():
    var = gpu_speed.Server("variant", Path("/m"), Path("/w"), Path("/l"), {}, {}, ["response_threads=4"])
    line = " ".join(var.command())
    assert "--setting stream_interval_ms=0 --setting response_threads=4" in line
    assert "--http-port 18640" in line
    assert "response_threads" not in " ".join(gpu_speed.Server("triton", Path("/m"), Path("/w"), Path("/l"), {},
                                                                {}).command())


def test_the_script_starts_both_servers_with_the_same_engine_arguments():
    engine = {"served_model_name": "llm", "max_model_len": 4096, "gpu_memory_utilization": 0.25}
    cmds = {side: gpu_speed.Server(side, Path("/m"), Path("/w"), Path("/l"), engine, {}).command()
            for side in ("triton", "vllm", "grouped")}
    assert cmds["vllm"][1:3] == ["-m", "vllm.entrypoints.openai.api_server"]
    assert "--served-model-name llm --max-model-len 4096 --gpu-memory-utilization 0.25" in " ".join(cmds["vllm"])
    for side in ("triton", "grouped"):
        line = " ".join(cmds[side])
        assert "serve --device gpu" in line and "--name llm" in line
        assert "--engine-arg max_model_len=4096 --engine-arg gpu_memory_utilization=0.25" in line
    assert "--setting stream_interval_ms=0" in " ".join(cmds["triton"])
    assert "--setting stream_interval_ms=50" in " ".join(cmds["grouped"])  # no longer the default


def test_engine_config_and_window_mean():
    line = ("(EngineCore pid=1) INFO 11-24 [core.py:109] Initializing a V1 LLM engine (v0.20.2) with config: "
            "model='/m', x=1")
    assert gpu_speed.engine_config("junk\n" + line) == {"version": "v0.20.2", "config": "model='/m', x=1"}
    assert gpu_speed.engine_config("nothing here") == {}
    assert gpu_speed.window_mean([(1.0, 10.0), (2.0, 20.0), (5.0, 99.0)], 1.0, 2.0) == 15.0
    assert gpu_speed.window_mean([(9.0, 1.0)], 1.0, 2.0) is None
