"""Plugins for trainers: :mod:`.lightning` (a Lightning ``CheckpointIO`` and sharded
strategies), :mod:`.hf` (a Hugging Face ``TrainerCallback``), :mod:`.accelerate`
(``Accelerator.save_state`` / ``load_state``), :mod:`.megatron` (a megatron-core
``dist_checkpointing`` strategy) and :mod:`.torchtitan` (a torchtitan checkpoint manager).

Nothing here is imported by ``fmstore`` itself, and each module imports its trainer library
only when it is imported, so fmstore never needs Lightning, transformers, Accelerate,
megatron-core or torchtitan installed.
The layer sits at the top, beside ``cli``: it may use the library's every layer.
"""
