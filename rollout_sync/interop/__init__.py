"""Conversions to and from other systems' layout descriptions (DeepSpeed's affine IR). Each module imports
its peer lazily, so importing this package costs nothing."""
