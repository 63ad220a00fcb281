import dataclasses

import pytest

from loong_compile import LoongConfig, LoongConfigError

GOOD = {
    "hp": 2, "cp": 4, "placement": "context_first", "inner_ring": 2, "head_groups": 2,
    "activations": "memo",
    "alpha": 0.25, "host_bandwidth": 12e9, "host_memory": 64 * 2**30, "layer_time": 0.004,
    "resident_layers": 0, "memory_plan": True, "solver_time_limit": 3.5, "dump_dir": "out/",
    "disable_passes": ("attention_2d",), "lowering": "aot_eager", "allow_graphs_without_attention": True,
    "token_local_ops": ("liger::rms_norm",), "rank_check_timeout": 30.0, "lm_head_chunk": 512,
    "tile_tokens": 4096, "inductor_options": {"cpp.simdlen": 1, "max_autotune": False},
}

BAD = {
    "hp": [0, -1, 1.5, "2", True],
    "cp": [0, 2.0, None],
    "placement": ["heads_first", 1],
    "inner_ring": [0, "x"],
    "head_groups": [0, 1.5, "2"],
    "activations": ["selective", None],
    "alpha": [-0.1, 1.5, "half", True],
    "host_bandwidth": [0, -1e9, "fast", True, float("nan"), float("inf")],
    "host_memory": [-1, "lots", None, float("inf")],
    "layer_time": [0, -0.5, "1ms", False],
    "resident_layers": [-1, 1.5, "2", None],
    "memory_plan": ["yes", 1],
    "solver_time_limit": [0, -3, "10"],
    "dump_dir": [3],
    "disable_passes": [[1, 2]],
    "lowering": ["aot_inductor"],
    "allow_graphs_without_attention": [0, "true"],
    "token_local_ops": [["rms_norm"], [3]],
    "rank_check_timeout": [0, -1, "soon"],
    "lm_head_chunk": [0, -4, "big", 1.5, True, None],
    "tile_tokens": [-1, "big", 1.5, True, None],
    "inductor_options": [{"max_autotuen": True}, [("max_autotune", True)], "max_autotune"],
}


def test_every_key_is_covered_by_these_tests():
    fields = {f.name for f in dataclasses.fields(LoongConfig)}
    assert set(GOOD) == fields
    assert set(BAD) == fields


def test_defaults_are_single_process():
    cfg = LoongConfig.from_options({}, environ={})
    assert (cfg.hp, cfg.cp, cfg.sp, cfg.activations, cfg.lowering) == (1, 1, 1, "none", "inductor")


# what a key's good value needs from other keys (the cross-field rules)
NEEDS = {"inner_ring": {"cp": GOOD["cp"]}}


@pytest.mark.parametrize("key", sorted(GOOD))
def test_each_key_accepts_a_good_value(key):
    cfg = LoongConfig.from_options({key: GOOD[key], **NEEDS.get(key, {})}, environ={})
    assert getattr(cfg, key) == GOOD[key]


@pytest.mark.parametrize("build", [
    lambda: LoongConfig(cp=4, inner_ring=3),
    lambda: LoongConfig.from_options({"inner_ring": 2}, environ={}),
    lambda: LoongConfig.from_options({"cp": 6}, environ={"LOONG_INNER_RING": "4"}),
])
def test_inner_ring_must_divide_cp(build):
    with pytest.raises(LoongConfigError, match=r"inner_ring=\d with cp=\d.*must divide cp.*fix: use inner_ring in \["):
        build()


@pytest.mark.parametrize("key,value", [(k, v) for k, vs in BAD.items() for v in vs])
def test_bad_values_name_key_rule_and_fix(key, value):
    with pytest.raises(LoongConfigError) as e:
        LoongConfig.from_options({key: value}, environ={})
    msg = str(e.value)
    assert key in msg and "rule:" in msg and "fix:" in msg


def test_unknown_option_lists_valid_keys():
    with pytest.raises(LoongConfigError, match="unknown option 'hpp'.*valid keys are hp, cp"):
        LoongConfig.from_options({"hpp": 2}, environ={})


def test_options_must_be_a_mapping():
    with pytest.raises(LoongConfigError, match="must be a dict or a LoongConfig"):
        LoongConfig.from_options([("hp", 2)], environ={})


def test_config_object_passes_through_and_is_frozen():
    cfg = LoongConfig(hp=2)
    assert LoongConfig.from_options(cfg) is cfg
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.hp = 4


ENV = {
    "LOONG_HP": "2", "LOONG_CP": "4", "LOONG_PLACEMENT": "context_first", "LOONG_INNER_RING": "2",
    "LOONG_ACTIVATIONS": "sc++", "LOONG_ALPHA": "0.5", "LOONG_HOST_BANDWIDTH": "2.5e10",
    "LOONG_HOST_MEMORY": "1e9", "LOONG_LAYER_TIME": "auto", "LOONG_RESIDENT_LAYERS": "1",
    "LOONG_MEMORY_PLAN": "yes",
    "LOONG_SOLVER_TIME_LIMIT": "2", "LOONG_DUMP_DIR": "/tmp/d", "LOONG_DISABLE_PASSES": "a,b",
    "LOONG_LOWERING": "eager", "LOONG_ALLOW_GRAPHS_WITHOUT_ATTENTION": "1",
    "LOONG_TOKEN_LOCAL_OPS": "liger::rms_norm", "LOONG_RANK_CHECK_TIMEOUT": "20",
    "LOONG_LM_HEAD_CHUNK": "256", "LOONG_TILE_TOKENS": "0", "LOONG_HEAD_GROUPS": "4", "LOONG_INDUCTOR_OPTIONS": '{"cpp.simdlen": 1}', "PATH": "/bin",
}


def test_environment_sets_every_key():
    cfg = LoongConfig.from_options(None, environ=ENV)
    assert cfg == LoongConfig(hp=2, cp=4, placement="context_first", inner_ring=2,
                              activations="sc++", alpha=0.5, host_bandwidth=2.5e10,
                              host_memory=1e9, layer_time="auto", resident_layers=1, memory_plan=True,
                              solver_time_limit=2.0, dump_dir="/tmp/d", disable_passes=("a", "b"),
                              lowering="eager", allow_graphs_without_attention=True,
                              token_local_ops=("liger::rms_norm",), rank_check_timeout=20.0,
                              lm_head_chunk=256, tile_tokens=0, inductor_options={"cpp.simdlen": 1},
                              head_groups=4)
    assert {f"LOONG_{f.name.upper()}" for f in dataclasses.fields(LoongConfig)} <= set(ENV)


def test_options_override_environment():
    cfg = LoongConfig.from_options({"hp": 4, "alpha": "auto"}, environ={"LOONG_HP": "2", "LOONG_ALPHA": "0.5"})
    assert (cfg.hp, cfg.alpha) == (4, "auto")


@pytest.mark.parametrize("name,value,match", [
    ("LOONG_HP", "two", "LOONG_HP='two'.*integer"),
    ("LOONG_MEMORY_PLAN", "maybe", "LOONG_MEMORY_PLAN='maybe'.*boolean"),
    ("LOONG_ALPHA", "2", "alpha=2.0.*\\[0, 1\\]"),
    ("LOONG_HOST_BANDWIDTH", "fast", "LOONG_HOST_BANDWIDTH='fast'.*bytes/s"),
    ("LOONG_RESIDENT_LAYERS", "-1", "resident_layers=-1.*>= 0"),
    ("LOONG_FOO", "1", "unknown environment variable LOONG_FOO"),
    ("LOONG_INDUCTOR_OPTIONS", "max_autotune=1", "LOONG_INDUCTOR_OPTIONS='max_autotune=1'.*JSON object"),
])
def test_bad_environment(name, value, match):
    with pytest.raises(LoongConfigError, match=match):
        LoongConfig.from_options(None, environ={name: value})
