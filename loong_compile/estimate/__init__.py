"""Memory estimator (sympy), 2D-Attention cost model and configuration search (docs/estimator.md).

None of it imports torch: ``loong plan`` runs on a laptop.
"""

from loong_compile.estimate.cost import AttentionCost, LayerCost, attention_cost, layer_cost
from loong_compile.estimate.hardware import PROFILES, HardwareProfile, load_hardware
from loong_compile.estimate.memory import (
    LayerActivations, MemoryBreakdown, MemoryOptions, ParallelConfig, SavedTensor, Term, category_bytes,
    estimate_memory, layer_activations, memory_terms,
)
from loong_compile.estimate.longest import LongestSequence, MeshReach, longest_sequence
from loong_compile.estimate.models import ModelSpec
from loong_compile.estimate.presets import PRESETS, load_model
from loong_compile.estimate.search import Candidate, Pruned, Ranking, plan
from loong_compile.estimate.step import StepCost, step_cost

Plan = Ranking  # the name before stop 29; the memory planner's plan had it too

__all__ = [
    "AttentionCost", "Candidate", "HardwareProfile", "LayerActivations", "LayerCost", "LongestSequence",
    "MemoryBreakdown", "MemoryOptions", "MeshReach", "ModelSpec", "PRESETS", "PROFILES", "ParallelConfig", "Plan", "Pruned", "Ranking", "SavedTensor",
    "Term", "attention_cost", "category_bytes", "estimate_memory", "layer_activations", "layer_cost",
    "load_hardware", "load_model", "longest_sequence", "memory_terms", "plan", "StepCost", "step_cost",
]
