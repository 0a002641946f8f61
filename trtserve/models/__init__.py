"""Model sources (local checkpoints, bundled models) and family detection."""
