"""Will it fit, and what did it hold: the peak per rank predicted before anything is built
(``predict``), from one micro-batch run on fake tensors (``fake_step``); and a rank's training
state counted, with PyTorch's ``MemTracker`` peak on CPU (``state``)."""
