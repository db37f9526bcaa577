"""dflash-stream: train DFlash drafters from hidden states streamed through a disk-budgeted Zarr ring buffer."""

__version__ = "0.1.0"
