"""Bytes and files, no model knowledge: safetensors headers and mmap reads (tensorfile), the one writer and its
transaction (writer), planned output parts (parts), a checkpoint tensor copied into a writer in bounded chunks
(passthrough), ONNX external data (onnx_data), and the manifest's file digests (digest)."""
