"""passes/fx/module_paths.py: every module path Dynamo writes into ``nn_module_stack`` is parsed,
leads to the module it names (``follow_module_path`` from the compiled frame, as
passes/fx/traced_modules.py::module_of walks it), and is named as ``named_modules`` names
that module, so that layers are found through PEFT's wrappers and users' containers (issue 51)."""

from __future__ import annotations

import collections

import pytest
import torch
from torch import nn

from helpers import Holder
from hf_models import build
from loong_compile._compat.dynamo import frame_variable
from loong_compile.passes.fx import traced_modules
from loong_compile.passes.fx.module_paths import (
    follow_module_path, layer_of_paths, module_path_parts, parse_module_path,
)

PEFT_ROOT = "L['self'].__dict__['_modules']['base_model'].__dict__['_modules']['model']"


@pytest.mark.parametrize("path, steps, names", [
    (f"{PEFT_ROOT}.model.layers.0.self_attn",
     [("attr", "__dict__"), ("item", "_modules"), ("item", "base_model"), ("attr", "__dict__"),
      ("item", "_modules"), ("item", "model"), ("attr", "model"), ("attr", "layers"),
      ("attr", "0"), ("attr", "self_attn")],
     "base_model.model.model.layers.0.self_attn"),
    ("L['self'].layers[3]._modules['mlp']",
     [("attr", "layers"), ("item", 3), ("attr", "_modules"), ("item", "mlp")], "layers.3.mlp"),
    ("getattr(L['s'], 'blk-1').lin", [("attr", "blk-1"), ("attr", "lin")], "blk-1.lin"),
    ("dict.__getitem__(L['s'].od, list(dict.keys(L['s'].od))[1]).lin",
     [("attr", "od"), ("key_at", 1), ("attr", "lin")], "od.1.lin"),
    ("list(L['s'].blocks)[2]", [("attr", "blocks"), ("at", 2)], "blocks.2"),
    ("L['s'].d['a \\'b']", [("attr", "d"), ("item", "a 'b")], "d.a 'b"),
])
def test_each_form_is_parsed(path, steps, names):
    parsed = parse_module_path(path)
    assert parsed is not None and list(parsed.steps) == steps
    assert ".".join(module_path_parts(path)) == names


def test_the_root_is_the_variable_and_its_items():
    parsed = parse_module_path("L['kwargs']['model'][0].model.layers.2")
    assert (parsed.scope, parsed.variable) == ("L", "kwargs")
    assert parsed.root_steps == (("item", "model"), ("item", 0))
    assert module_path_parts("L['kwargs']['model'][0].model.layers.2") == ["model", "layers", "2"]


@pytest.mark.parametrize("text", ["type(L['x'])", "L['self'].a b", "self.layers.0", "L[self]",
                                  "getattr(L['s'])", "<ephemeral>"])
def test_what_is_no_module_path_is_none(text):
    assert parse_module_path(text) is None and module_path_parts(text) == []


def test_a_step_that_leads_nowhere_is_none():
    model = nn.Sequential(nn.Linear(2, 2))
    assert follow_module_path(model, [("attr", "0")]) is model[0]
    assert follow_module_path(model, [("attr", "1")]) is None
    assert follow_module_path(model, [("item", 5)]) is None
    assert follow_module_path([model], [("key_at", 0)]) is None


class _Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        return self.lin(x)


class _OwnDict(collections.OrderedDict):
    def __getitem__(self, key):   # a dict subclass Dynamo reads with dict.__getitem__
        return super().__getitem__(key)


class _Containers(nn.Module):
    """Blocks where users keep them: a list and a dict (not registered), a ModuleDict, a
    ModuleList of Sequentials, a tuple, a dict subclass, a name that is no identifier."""

    def __init__(self):
        super().__init__()
        self.plain = [_Block(), _Block()]
        self.by_name = {"a": _Block()}
        self.module_dict = nn.ModuleDict({"b": _Block(), "0": _Block()})
        self.layers = nn.ModuleList([nn.Sequential(_Block(), _Block())])
        self.pair = (_Block(),)
        self.own = _OwnDict(c=_Block())
        self.add_module("blk-1", _Block())

    def forward(self, x):
        for block in self.plain:
            x = block(x)
        x = self.by_name["a"](x)
        for block in self.module_dict.values():
            x = block(x)
        x = self.layers[0](x)
        x = self.pair[0](x)
        x = self.own["c"](x)
        return getattr(self, "blk-1")(x)


def _lora_llama():
    from peft import LoraConfig, get_peft_model

    return get_peft_model(build("llama", dtype=torch.float32),
                          LoraConfig(target_modules=["q_proj", "v_proj", "up_proj"]))


def _traced(fn, *args) -> list[tuple[torch.fx.Node, str, type, object]]:
    """Every ``nn_module_stack`` entry of the graph Dynamo hands the backend, with the module
    its path leads to from the compiled frame, and what ``traced_modules.module_of`` finds for the
    node (both read while the frame is being compiled, as the attention pass reads them)."""
    entries = []

    def backend(gm, example_inputs):
        root = traced_modules.compiled_module(gm)
        for node in gm.graph.nodes:
            stack = node.meta.get("nn_module_stack") or {}
            for path, cls in stack.values():
                parsed = parse_module_path(path)
                assert parsed is not None, path
                start = frame_variable(parsed.scope, parsed.variable)
                found = follow_module_path(start, [*parsed.root_steps, *parsed.steps])
                entries.append((path, cls, found, root))
            if stack:
                innermost = list(stack.values())[-1]
                entries.append((innermost[0], innermost[1], traced_modules.module_of(root, node), root))
        return gm.forward

    torch._dynamo.reset()
    torch.compile(fn, backend=backend, fullgraph=True)(*args)
    return entries


def test_peft_paths_lead_to_the_modules_named_as_peft_names_them():
    model = _lora_llama()
    ids = torch.randint(0, 64, (2, 16))
    entries = _traced(model, ids)
    names = dict(model.named_modules())
    assert any("__dict__" in path for path, *_ in entries)     # PEFT's forwarding, as the issue saw it
    for path, cls, found, root in entries:
        assert root is model
        assert type(found) is cls, path
        if parse_module_path(path).scope == "G" and found not in names.values():
            continue    # a function the kernels package made a module (transformers >= 5.25's
            #             RoPE), a global of transformers' modeling module, not the model's
        assert names[".".join(module_path_parts(path))] is found, path
    layers = {layer_of_paths([path]) for path, *_ in entries} - {None}
    assert layers == {"base_model.model.model.layers.0"}


def test_users_containers_lead_to_their_modules():
    model = _Containers()
    x = torch.randn(2, 4)
    CONTAINERS[:] = [model]
    paths = set()
    for traced in (model, lambda x: CONTAINERS[0](x)):   # its forward, and a step on a global
        for path, cls, found, _ in _traced(traced, x):
            assert type(found) is cls, path
            paths.add(path)
    for form in ("L['self'].plain[1]", "L['self'].by_name['a']", "getattr(L['self'], 'blk-1')",
                 "dict.__getitem__(L['self'].own", "G['CONTAINERS'][0].pair[0]"):
        assert any(path.startswith(form) for path in paths), form
    assert layer_of_paths(["L['self'].plain[1].lin"]) == "plain.1"


def test_a_step_holding_the_model_in_an_object_leads_to_its_modules():
    """``L['self']`` is no module here (the holder): the paths are followed from it, and the
    compiled module is the model the first path reaches."""
    model = _Containers()
    entries = _traced(Holder(model).step(), torch.randn(2, 4))
    assert entries and all("L['self'].model" in path for path, *_ in entries)
    for path, cls, found, root in entries:
        assert type(found) is cls, path
        assert root is model


CONTAINERS: list[nn.Module] = []
