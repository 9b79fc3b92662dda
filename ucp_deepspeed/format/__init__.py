"""The universal format and our save metadata: typed records, the reader and writer, what a path holds."""
