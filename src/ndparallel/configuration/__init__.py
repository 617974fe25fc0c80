"""Configuration: `ParallelismConfig` (`parallelism`), its handlers (`handlers`), dtypes (`dtypes`), the
environment and files settings come from (`environment`), and Accelerate's plugins and kwargs
handlers (`plugins`, `plugin_fields`)."""
