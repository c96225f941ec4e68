"""The bundled torch-native trainer (DESIGN.md "Trainer").

Modules: config (run configuration, torch-free), model (single-device MoE
transformer), parallelize (apply_* over DeviceMeshes), data, checkpoint (DCP),
metrics (JSONL), train (the loop and the rank entry point). Only the modules
other than config import torch; importing this package does not.
"""
