"""Slurm launch recipes: sbatch scripts for multi-node hybridflow jobs (render.py)."""
