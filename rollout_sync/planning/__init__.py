"""Pure planning: from source and target maps to a deterministic plan of point-to-point copies."""
