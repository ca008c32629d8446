"""The product glue: the trainer hook and the rollout worker's session, joined by the handshake."""
