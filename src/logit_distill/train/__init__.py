"""Student training from a logit store: losses, schedules, loader, loop, export."""
