"""Supervised fine-tuning (``hybridflow sft``): its config, the job that checks and launches it, and the
trainer loop over the actor's ``sft_step``."""
