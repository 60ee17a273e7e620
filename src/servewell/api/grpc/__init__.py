"""OIP v2 over gRPC, in the frontend process, on the same engine and data plane as HTTP."""
