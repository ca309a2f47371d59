"""LoRA: enable_lora, multi_lora.json beside model.json, a request's lora_name, and
the tiny adapter generator."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from llmhost.backend.config import ConfigError, parse_model_config
from llmhost.backend.errors import RequestError
from llmhost.backend.lora import (
    NOT_ENABLED,
    Adapter,
    check_published,
    find_adapter,
    load_adapters,
    lora_request,
    request_lora_name,
    with_adapters,
)
from llmhost.backend.request import parse_request
from llmhost.tiny.lora import RANK, SHAPES, write_tiny_lora
from tests.unit.test_request import S, arr


@pytest.fixture
def adapter(tmp_path: Path) -> Path:
    return write_tiny_lora(tmp_path / "adapters" / "alpha", seed=1)


def _model_json(tmp_path: Path, multi: object | None, **engine: object) -> Path:
    d = tmp_path / "model"
    d.mkdir(exist_ok=True)
    (d / "model.json").write_text(json.dumps({"model": "/m", **engine}))
    if multi is not None:
        (d / "multi_lora.json").write_text(multi if isinstance(multi, str) else json.dumps(multi))
    return d / "model.json"


def test_adapters_in_file_order_with_fixed_ids(tmp_path: Path, adapter: Path):
    beta = write_tiny_lora(tmp_path / "adapters" / "beta", seed=2)
    path = _model_json(tmp_path, {"beta": str(beta), "alpha": "../adapters/alpha"}, enable_lora="true")
    config, note = with_adapters(parse_model_config(json.loads(path.read_text())), path)
    assert config.adapters == (Adapter("beta", 1, str(beta)),
                               Adapter("alpha", 2, str(path.parent / "../adapters/alpha")))
    # vllm_backend's string "true" reaches vLLM as a bool.
    assert config.engine_args["enable_lora"] is True
    assert "beta, alpha" in note and str(path.parent / "multi_lora.json") in note


def test_lora_off_ignores_the_file_and_says_so(tmp_path: Path):
    path = _model_json(tmp_path, {"alpha": "/nowhere"}, enable_lora=False)
    adapters, note = load_adapters(path, {"enable_lora": False})
    assert adapters == [] and "is ignored" in note
    (tmp_path / "b").mkdir()
    assert load_adapters(_model_json(tmp_path / "b", None), {}) == ([], "")


@pytest.mark.parametrize(("multi", "engine", "needle"), [
    (None, {"enable_lora": True}, "model.json sets enable_lora, but {file} does not exist"),
    ('{"alpha": ', {"enable_lora": True}, "{file} is not valid JSON"),
    (["alpha"], {"enable_lora": True}, "{file} must hold a JSON object mapping adapter names"),
    ({}, {"enable_lora": True}, "{file} names no adapter"),
    ({"alpha": 3}, {"enable_lora": True}, "{file}, adapter 'alpha': the adapter directory must be a non-empty"),
    ({"alpha": "/no/such/dir"}, {"enable_lora": True}, "{file}, adapter 'alpha': /no/such/dir is not a directory"),
    ({" ": "/tmp"}, {"enable_lora": True}, "adapter name ' ' must be 1 to 256 printable characters"),
    ({"alpha": "ADAPTER"}, {"enable_lora": True, "max_lora_rank": 1},
     "{file}, adapter 'alpha': the adapter's rank 8 exceeds max_lora_rank 1"),
    ({"alpha": "ADAPTER"}, {"enable_lora": "yes"}, "'enable_lora' must be true or false, got 'yes'"),
    ({"alpha": "ADAPTER"}, {"enable_lora": True, "max_lora_rank": "8"}, "'max_lora_rank' must be an integer"),
])
def test_bad_multi_lora_json_names_file_and_entry(tmp_path: Path, adapter: Path, multi: object, engine: dict,
                                                  needle: str):
    if isinstance(multi, dict):
        multi = {k: str(adapter) if v == "ADAPTER" else v for k, v in multi.items()}
    path = _model_json(tmp_path, multi, **engine)
    with pytest.raises(ConfigError) as err:
        with_adapters(parse_model_config(json.loads(path.read_text())), path)
    assert needle.format(file=path.parent / "multi_lora.json") in str(err.value)


def test_directory_without_adapter_config(tmp_path: Path):
    (tmp_path / "empty").mkdir()
    path = _model_json(tmp_path, {"alpha": str(tmp_path / "empty")}, enable_lora=True)
    with pytest.raises(ConfigError, match=r"adapter 'alpha': .*empty holds no adapter_config.json"):
        load_adapters(path, {"enable_lora": True})


def test_request_lora_name_is_taken_out_of_the_sampling_parameters():
    job = parse_request({"text_input": arr("hi")}, json.dumps({"lora_name": "alpha", "temperature": 0}), S)
    assert job.lora_name == "alpha" and "lora_name" not in job.sampling
    job = parse_request({"text_input": arr("hi"),
                         "sampling_parameters": arr(json.dumps({"lora_name": "beta"}))}, None, S)
    assert job.lora_name == "beta"
    assert parse_request({"text_input": arr("hi")}, None, S).lora_name is None


@pytest.mark.parametrize("value", ["", "   ", 3, ["alpha"], "x" * 257])
def test_bad_lora_name(value: object):
    with pytest.raises(RequestError, match="sampling parameter 'lora_name' must be an adapter's name"):
        request_lora_name({"lora_name": value})


def test_find_adapter():
    table = (Adapter("alpha", 1, "/a"), Adapter("beta", 2, "/b"))
    assert find_adapter("beta", table) == table[1]
    with pytest.raises(RequestError) as err:
        find_adapter("gamma", table)
    assert str(err.value) == ("LoRA gamma is not supported, we currently support ['alpha', 'beta']; sampling "
                              "parameter 'lora_name' must name an adapter of the model's multi_lora.json")
    with pytest.raises(RequestError, match=r"^LoRA 'a\\nb' is not supported"):
        find_adapter("a\nb", table)
    with pytest.raises(RequestError) as err:
        find_adapter("alpha", ())
    assert str(err.value).startswith(NOT_ENABLED) and "enable_lora" in str(err.value)


def _published(names: list[str] | None) -> dict[str, object]:
    """The model configuration, as Triton hands it to the backend, of config.pbtxt.j2
    rendered with NAMES as the model's adapters."""
    from google.protobuf import json_format, text_format
    from tritonclient.grpc import model_config_pb2

    from llmhost.server.layout import render

    text = render("config.pbtxt.j2", model={"name": "m", **({"lora_adapters": names} if names is not None else {})})
    return json_format.MessageToDict(text_format.Parse(text, model_config_pb2.ModelConfig()),
                                     preserving_proto_field_name=True)


# Names as multi_lora.json may give them: printable, quotes and backslashes too.
ODD_NAMES = ["alpha", 'b"eta', "c\\d", "über"]


def test_config_pbtxt_publishes_the_adapter_names_the_gateway_reads():
    from tritonclient.grpc import service_pb2

    from llmhost.gateway.routing.pool import published_adapters

    config = _published(ODD_NAMES)
    adapters = tuple(Adapter(name, i, f"/a/{i}") for i, name in enumerate(ODD_NAMES, start=1))
    check_published(config, adapters)
    response = service_pb2.ModelConfigResponse(config=config)
    assert published_adapters(response) == tuple(ODD_NAMES)
    assert "lora_adapters" not in _published(None).get("parameters", {})
    assert "lora_adapters" not in _published([]).get("parameters", {})


@pytest.mark.parametrize("names", [["alpha"], ["beta", "alpha"], ["alpha", "beta", "gamma"]])
def test_a_published_list_unlike_multi_lora_json_fails_the_load(names: list[str]):
    adapters = (Adapter("alpha", 1, "/a"), Adapter("beta", 2, "/b"))
    with pytest.raises(ConfigError, match=r"config.pbtxt's parameter 'lora_adapters' must be the JSON list of the "
                                          r'adapter names the model serves \(\["alpha", "beta"\]'):
        check_published(_published(names), adapters)
    with pytest.raises(ConfigError, match="lora_adapters"):
        check_published(_published(["alpha"]), ())  # LoRA off: nothing may be published
    check_published(_published(None), adapters)  # none published (a hand-made config.pbtxt): nothing to check


def test_serve_publishes_multi_lora_names_only_with_lora_on(tmp_path: Path):
    from llmhost.server.serve import published_adapters

    multi = tmp_path / "multi_lora.json"
    multi.write_text(json.dumps({"beta": "/b", "alpha": "/a"}))
    assert published_adapters(multi, {"enable_lora": True}) == ["beta", "alpha"]
    assert published_adapters(multi, {"enable_lora": "true"}) == ["beta", "alpha"]
    assert published_adapters(multi, {}) == []
    assert published_adapters(None, {"enable_lora": True}) == []
    multi.write_text("[")
    assert published_adapters(multi, {"enable_lora": True}) == []


def test_lora_request_carries_the_fixed_id():
    req = lora_request(Adapter("beta", 2, "/b"))
    assert (req.lora_name, req.lora_int_id, req.lora_path) == ("beta", 2, "/b")


def test_tiny_adapter_shapes_and_effect(tmp_path: Path):
    from safetensors.torch import load_file

    a = write_tiny_lora(tmp_path / "a", seed=1)
    b = write_tiny_lora(tmp_path / "b", seed=1)
    c = write_tiny_lora(tmp_path / "c", seed=2)
    assert (a / "adapter_model.safetensors").read_bytes() == (b / "adapter_model.safetensors").read_bytes()
    assert (a / "adapter_model.safetensors").read_bytes() != (c / "adapter_model.safetensors").read_bytes()
    config = json.loads((a / "adapter_config.json").read_text())
    assert config["peft_type"] == "LORA" and config["r"] == RANK
    assert sorted(config["target_modules"]) == sorted(SHAPES)
    tensors = load_file(str(a / "adapter_model.safetensors"))
    q_a = tensors["base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"]
    k_b = tensors["base_model.model.model.layers.3.self_attn.k_proj.lora_B.weight"]
    down_a = tensors["base_model.model.model.layers.2.mlp.down_proj.lora_A.weight"]
    assert tuple(q_a.shape) == (RANK, 256) and tuple(k_b.shape) == (128, RANK) and tuple(down_a.shape) == (RANK, 512)
    # B is not zero (a fresh PEFT adapter's is): the adapter changes the output.
    assert all(t.abs().sum() > 0 for k, t in tensors.items() if "lora_B" in k)
    assert len(tensors) == 4 * len(SHAPES) * 2
    assert oct((a / "adapter_model.safetensors").stat().st_mode & 0o777) == "0o644"


def test_tiny_adapter_refuses_foreign_directory(tmp_path: Path):
    (tmp_path / "keep.txt").write_text("keep")
    with pytest.raises(ValueError, match="refusing to overwrite"):
        write_tiny_lora(tmp_path)


def test_vllm_backend_layout_reads_the_version_directorys_file(tmp_path: Path, adapter: Path):
    """<model>/1/model.json (vllm_backend's place) takes multi_lora.json from <model>/1/ too."""
    from llmhost.backend.config import load_model_config, locate_model_json

    model = tmp_path / "repo" / "m"
    (model / "1").mkdir(parents=True)
    (model / "model.json").write_text(json.dumps({"model": "/m"}))
    (model / "multi_lora.json").write_text(json.dumps({"wrong": str(adapter)}))
    (model / "1" / "model.json").write_text(json.dumps({"model": "/m", "enable_lora": "true"}))
    (model / "1" / "multi_lora.json").write_text(json.dumps({"alpha": str(adapter)}))
    path, _ = locate_model_json(model, "1")
    config, _ = with_adapters(load_model_config(path), path)
    assert [a.name for a in config.adapters] == ["alpha"]
