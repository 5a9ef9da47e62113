"""The eviction step and what surrounds it in the scheduler: the batched eviction, eviction during
prefill, retraction, budget-aware admission, attention statistics, Naive-Evict's held pages."""
