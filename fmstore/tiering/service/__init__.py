"""What runs the policies besides the training loop: ``fmstore daemon`` (:mod:`.daemon`,
its HTTP endpoint :mod:`.endpoint`), the policy helper child of a training process
(:mod:`.helper`) and its in-process runner thread (:mod:`.background`), at background CPU and
I/O priority (:mod:`.priority`)."""
