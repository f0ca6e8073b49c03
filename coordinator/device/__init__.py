"""The coordinator's device side: device weights in compact storage formats, their kernels, VRAM accounting."""
