"""The draft methods, one module each."""
