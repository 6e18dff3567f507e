"""Plan-time checks of pipeline specs: every mistake fails before any work, in one line naming the fix."""
from __future__ import annotations

import dataclasses
import types

import pytest

from kdtree.pipeline import registry as stages
from kdtree.errors import PipelineError
from kdtree.pipeline.spec import available_pipelines, load_pipeline, pipeline_path


def _spec(tmp_path, body: str):
    p = tmp_path / "p.yaml"
    p.write_text(body)
    return str(p)


def _fails(compose_cfg, tmp_path, body: str, *overrides) -> str:
    path = _spec(tmp_path, body)
    with pytest.raises(PipelineError) as e:
        load_pipeline(path, compose_cfg(f"pipeline={path}", *overrides))
    msg = str(e.value)
    assert "\n" not in msg
    return msg


def test_named_pipelines_resolve_from_the_repo():
    assert {"serve", "generate", "plan", "stop"} <= set(available_pipelines())
    assert pipeline_path("generate").name == "generate.yaml"


def test_unknown_pipeline_lists_the_known_ones():
    with pytest.raises(PipelineError, match=r"pipeline=nope: unknown pipeline; known pipelines: .*generate.*plan"):
        pipeline_path("nope")


def test_params_interpolate_the_composed_config(compose_cfg, tmp_path):
    path = _spec(tmp_path, "name: t\nstages:\n  - {stage: fail, on: host, params: {message: 'p=${serve.port} "
                           "${model.name}', delay_s: '${serve.port}', timeout_s: 3}}\n")
    spec = load_pipeline(path, compose_cfg(f"pipeline={path}", "serve.port=4242"))
    (s,) = spec.stages
    assert (s.stage, s.on, s.timeout_s) == ("fail", "host", 3.0)
    assert s.params == {"message": "p=4242 tiny", "delay_s": 4242, "wrap_interrupts": False}  # + the default


def test_groups_put_consecutive_host_stages_in_one_process(compose_cfg):
    spec = load_pipeline("generate", compose_cfg("pipeline=generate", "prompt=hi", "max_new_tokens=3"))
    assert [(side, [s.stage for s in g]) for side, g in spec.groups()] == [("host", ["load", "generate"])]
    assert spec.stages[1].params == {}   # generate reads prompt / max_new_tokens from the config


def test_unknown_stage_lists_the_known_ones(compose_cfg, tmp_path):
    msg = _fails(compose_cfg, tmp_path, "stages:\n  - {stage: lod, on: host}\n")
    assert "unknown stage 'lod'; known stages:" in msg and "load" in msg and "plan" in msg


def test_unknown_parameter(compose_cfg, tmp_path):
    msg = _fails(compose_cfg, tmp_path, "stages:\n  - {stage: fail, params: {mesage: x}}\n")
    assert "unknown parameter(s) mesage; known: delay_s, message, wrap_interrupts, timeout_s" in msg


def _stage_with_config(name: str, conf: type) -> types.ModuleType:
    m = types.ModuleType(name)
    m.SIDE, m.CONFIG, m.run = "controller", conf, lambda ctx, conf: None
    return m


def test_missing_parameter(compose_cfg, tmp_path):
    needs = dataclasses.make_dataclass("NeedsConfig", [("url", str, dataclasses.field(default="???"))])
    stages.register_stage("needs", _stage_with_config("needs", needs))
    try:
        msg = _fails(compose_cfg, tmp_path, "stages:\n  - {stage: needs}\n")
        assert "stage #0 'needs': missing parameter(s) url; add them under params: or set needs.url" in msg
    finally:
        stages.unregister_stage("needs")


def test_params_override_the_section_and_the_rest_comes_from_it(compose_cfg):
    spec = load_pipeline("bench", compose_cfg("pipeline=bench", "bench.repeats=5"))
    assert spec.stages[1].params == {"prompts": "", "max_new_tokens": 48, "repeats": 5, "grammar": "", "trees": []}


def test_a_stage_without_config_takes_no_params(compose_cfg, tmp_path):
    msg = _fails(compose_cfg, tmp_path, "stages:\n  - {stage: load, on: host, params: {path: x}}\n")
    assert "stage #0 'load': unknown parameter(s) path; known: timeout_s" in msg


def test_mistyped_parameter_names_value_and_type(compose_cfg, tmp_path):
    msg = _fails(compose_cfg, tmp_path, "stages:\n  - {stage: fail, params: {delay_s: '${prompt}'}}\n")
    assert "parameter delay_s='2+2=' is str, expected float" in msg


def test_unresolvable_interpolation(compose_cfg, tmp_path):
    msg = _fails(compose_cfg, tmp_path, "stages:\n  - {stage: fail, params: {message: '${serve.nope}'}}\n")
    assert "parameter message='${serve.nope}' cannot be resolved" in msg


def test_bad_timeout(compose_cfg, tmp_path):
    msg = _fails(compose_cfg, tmp_path, "stages:\n  - {stage: fail, params: {timeout_s: -1}}\n")
    assert "timeout_s=-1; give a positive number of seconds" in msg


def test_stage_on_the_wrong_side(compose_cfg, tmp_path):
    msg = _fails(compose_cfg, tmp_path, "stages:\n  - {stage: load, on: controller}\n")
    assert "stage #0 'load' runs on the host side only, got on: controller; write on: host" in msg


def test_controller_stage_that_needs_the_engine_must_follow_a_host_stage(compose_cfg, tmp_path):
    watcher = types.ModuleType("watcher")
    watcher.SIDE = "controller"
    watcher.CONFIG = dataclasses.make_dataclass("WatcherConfig", [("url", str, dataclasses.field(default=""))])
    watcher.NEEDS_ENGINE = lambda params, cfg: not params.get("url")
    watcher.run = lambda ctx, conf: None
    stages.register_stage("watcher", watcher)
    try:
        msg = _fails(compose_cfg, tmp_path, "stages:\n  - {stage: watcher}\n  - {stage: load, on: host}\n")
        assert "stage #0 'watcher' (controller) watches this run's engine but no host stage runs before it" in msg
        ok = _spec(tmp_path, "stages:\n  - {stage: watcher, params: {url: 'http://x:1'}}\n  - {stage: load}\n")
        assert [s.on for s in load_pipeline(ok, compose_cfg(f"pipeline={ok}")).stages] == ["controller", "host"]
    finally:
        stages.unregister_stage("watcher")


def test_malformed_entries(compose_cfg, tmp_path):
    assert "unknown key(s) param; allowed: stage, on, params" in _fails(
        compose_cfg, tmp_path, "stages:\n  - {stage: fail, param: {}}\n")
    assert "non-empty `stages:` list" in _fails(compose_cfg, tmp_path, "name: x\n")
    assert "on='gpu'; use on: host or on: controller" in _fails(
        compose_cfg, tmp_path, "stages:\n  - {stage: fail, on: gpu}\n")
