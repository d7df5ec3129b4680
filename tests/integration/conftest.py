from store_fixtures import store_process, store_redis  # noqa: F401
