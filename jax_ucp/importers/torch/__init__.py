"""Torch checkpoints read without torch: the allow-listed unpickler, the torch DCP reader and
importer, ``torch.save`` files, and torch optimizers' state conventions."""
