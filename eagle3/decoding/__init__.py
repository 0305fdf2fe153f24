"""The decoders: the in-house drafters that propose tokens for speculative decoding."""
