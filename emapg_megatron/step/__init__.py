"""The parts of one RL step that the trainer (``trainer.py``) orchestrates and no lower layer
knows: the policy passes on the model's output (``passes.py``), the step's metrics from its
phases' records (``metrics.py``) and the state a checkpoint keeps of a run (``state.py``)."""
