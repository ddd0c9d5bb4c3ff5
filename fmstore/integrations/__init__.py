"""Plugins for trainers: :mod:`.lightning` (a Lightning ``CheckpointIO``), :mod:`.hf`
(a Hugging Face ``TrainerCallback``) and :mod:`.accelerate` (``Accelerator.save_state`` /
``load_state``).

Nothing here is imported by ``fmstore`` itself, and each module imports its trainer library
only when it is imported, so fmstore never needs Lightning, transformers or Accelerate installed.
The layer sits at the top, beside ``cli``: it may use the library's every layer.
"""
