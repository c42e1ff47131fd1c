"""Generation: dynamic batching generator, jobs, scheduler, samplers, streaming."""
from .generator import Generator, GeneratorStats
from .job import Job, JobResult

__all__ = ["Generator", "GeneratorStats", "Job", "JobResult"]
