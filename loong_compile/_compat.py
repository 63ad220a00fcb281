"""Every use of a private torch API lives here, so a torch upgrade touches one file.

Sections are grouped by the part of loong_compile that needs them.  Each
function documents which torch versions it was checked against.
"""

from __future__ import annotations

import torch

TORCH_VERSION = torch.__version__

# --- distributed: process groups by name (ops/, mesh.py) ---------------------

# --- dynamo backend registry (backend.py) ------------------------------------

# --- AOTAutograd / partitioner (backend.py, passes/activations.py) ----------

# --- structured trace logging (inspect.py) -----------------------------------

# --- Inductor memory planning (passes/memory_plan.py) ------------------------
