"""The values the forward saves for the backward, as an editable list: add, replace, remove
or rebase a saved value while keeping AOTAutograd's pairing of forward outputs with backward
placeholders.
"""

from __future__ import annotations

import torch
import torch.fx

from loong_compile.passes.base import SplitGraphs
from loong_compile.passes.fx.storage import base_of, view_path
from loong_compile.passes.fx.walks import first_in_order


class SavedValues:
    """Edit what the forward saves for the backward, keeping AOTAutograd's pairing: the
    forward's outputs after ``num_fwd_outputs`` are the backward's first placeholders, in the
    same order, tensors first and symbolic ints after."""

    def __init__(self, split: SplitGraphs, keep: set[torch.fx.Node] = frozenset()):
        self.keep = keep             # saved as they are even if they are views (token prefixes)
        self.fw, self.bw = split.forward.graph, split.backward.graph
        self.output = self.fw.find_nodes(op="output")[0]
        outs = list(self.output.args[0])
        self.user_outputs = outs[:split.num_fwd_outputs]
        saved = outs[split.num_fwd_outputs:]
        placeholders = list(self.bw.find_nodes(op="placeholder"))
        self.tensors: list[list[torch.fx.Node]] = []   # [forward node, backward placeholder]
        self.others: list[torch.fx.Node] = []          # symbolic values, kept as they are
        for fw_node, ph in zip(saved, placeholders):
            if isinstance(fw_node, torch.fx.Node) and isinstance(fw_node.meta.get("val"), torch.Tensor):
                self.tensors.append([fw_node, ph])
            else:
                self.others.append(fw_node)
        # indexes, so that editing every saved value of an 80-layer graph stays linear
        self._pair: dict[torch.fx.Node, list[torch.fx.Node]] = {}
        for pair in self.tensors:
            self._pair.setdefault(pair[0], pair)
        self._base: dict[torch.fx.Node, torch.fx.Node] = {}
        self._bw_names: set[str] | None = None

    def __iter__(self):
        return iter([tuple(pair) for pair in self.tensors])

    def placeholder(self, fw_node: torch.fx.Node) -> torch.fx.Node | None:
        pair = self._pair.get(fw_node)
        return None if pair is None else pair[1]

    def add(self, fw_node: torch.fx.Node) -> torch.fx.Node:
        """Save ``fw_node`` too (if it isn't yet); its backward placeholder."""
        existing = self.placeholder(fw_node)
        if existing is not None:
            return existing
        anchor = self.tensors[-1][1] if self.tensors else None
        if anchor is None:
            first = next(iter(self.bw.nodes))
            ctx = self.bw.inserting_before(first)
        else:
            ctx = self.bw.inserting_after(anchor)
        with ctx:
            ph = self._placeholder_named_like(fw_node.name)
        ph.meta["val"] = fw_node.meta["val"]
        self.tensors.append([fw_node, ph])
        self._pair[fw_node] = self.tensors[-1]
        self._commit()
        return ph

    def replace(self, fw_old: torch.fx.Node, fw_new: torch.fx.Node) -> torch.fx.Node:
        """Save ``fw_new`` in ``fw_old``'s place; the same placeholder, with the new value."""
        pair = self._pair.pop(fw_old, None)
        if pair is None:
            raise KeyError(fw_old.name)
        pair[0] = fw_new
        self._pair.setdefault(fw_new, pair)
        pair[1].meta["val"] = fw_new.meta["val"]
        self._commit()
        return pair[1]

    def remove(self, fw_node: torch.fx.Node) -> None:
        """Stop saving ``fw_node``; its placeholder must have no users left."""
        for k, (node, ph) in enumerate(self.tensors):
            if node is fw_node:
                if ph.users:
                    raise RuntimeError(f"{ph.name} is still used by {list(ph.users)}")
                self.bw.erase_node(ph)
                del self.tensors[k]
                del self._pair[fw_node]
                self._commit()
                return
        raise KeyError(fw_node.name)

    def rebase(self, base: torch.fx.Node) -> torch.fx.Node:
        """Save ``base`` alone instead of views of it: the backward rebuilds each view from the
        base's placeholder right before the view's first use.  Returns the base's placeholder."""
        views = [node for node, _ in self.tensors
                 if node is not base and node not in self.keep and self._base_of(node) is base]
        if not views and self.placeholder(base) is not None:
            return self.placeholder(base)
        base_ph = self.add(base)
        for view in views:
            ph = self.placeholder(view)
            users = list(ph.users)
            if users:
                with self.bw.inserting_before(first_in_order(users)):
                    env = {base: base_ph}
                    for node in view_path(view):
                        env[node] = self.bw.node_copy(node, env.__getitem__)
                for user in users:
                    user.replace_input_with(ph, env[view])
            self.remove(view)
        return base_ph

    def _base_of(self, node: torch.fx.Node) -> torch.fx.Node:
        if node not in self._base:
            self._base[node] = base_of(node)
        return self._base[node]

    def _placeholder_named_like(self, name: str) -> torch.fx.Node:
        """A new backward placeholder whose name is ``name`` (or ``name`` + ``_saved``...).  Its
        target is its argument name in the generated code: keep it equal to the node's name by
        choosing a name FX has not given (FX would rename only the node).  The names are
        collected once; a name FX refuses (a node made since, or one erased) is skipped."""
        if self._bw_names is None:
            self._bw_names = {n.name for n in self.bw.nodes}
        while True:
            while name in self._bw_names:
                name += "_saved"
            ph = self.bw.placeholder(name)
            self._bw_names.update((name, ph.name))
            if ph.name == name:
                return ph
            self.bw.erase_node(ph)

    def _commit(self) -> None:
        saved = [node for node, _ in self.tensors] + self.others
        self.output.update_arg(0, tuple(self.user_outputs + saved))
