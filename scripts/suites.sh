# The library-facing suites that scripts/test-floors and scripts/test-python run once more
# beside the main run. Sourced.

# The tests of the code that calls a library an extra declares (redis-py, SQLAlchemy,
# psycopg, PyMySQL, aiomysql, httpx, kazoo, prometheus-client, opentelemetry-api, Celery,
# Django): guards, managers, the ORM hook, the Django app, the etcd and ZooKeeper managers, the
# metrics, the Celery task, the examples and the docs' blocks. Not here:
# what runs no library code (the core, the memory manager, the quorum's model checker) and
# what measures (benchmarks).
SUITES=(
  tests/test_guard_kit.py
  tests/_async/test_manager_conformance.py tests/_sync/test_manager_conformance.py
  tests/_async/test_redis_manager.py tests/_sync/test_redis_manager.py
  tests/_async/test_sql_manager.py tests/_sync/test_sql_manager.py
  tests/_async/test_orm_hook.py tests/_sync/test_orm_hook.py
  tests/_async/test_orm_repository.py tests/_sync/test_orm_repository.py
  tests/test_redis_guard.py tests/test_redis_guard_batches.py tests/test_redis_guard_faults.py
  tests/test_redis_manager_faults.py tests/test_redis_acl.py tests/test_redis_guard_verdicts.py
  tests/test_sql_guard.py tests/test_sql_guard_async.py tests/test_sql_batches.py
  tests/test_sql_isolation.py tests/test_psycopg_guard.py tests/test_psycopg_guard_async.py
  tests/test_mariadb_guard.py tests/test_etcd_guard.py tests/test_zookeeper_guard.py
  tests/test_orm.py tests/test_orm_fail_closed.py
  tests/test_write_paths_redis.py tests/test_write_paths_sql.py
  tests/test_consensus_managers.py
  tests/test_prometheus.py tests/test_otel.py tests/test_observe.py
  tests/_async/test_shared_conformance.py tests/_sync/test_shared_conformance.py tests/test_sqlite_clock.py
  tests/_async/test_orm_read_lease.py tests/_sync/test_orm_read_lease.py tests/test_read_tokens.py
  tests/test_sentinel.py
  tests/test_celery.py tests/test_django.py tests/test_django_pytest.py
  tests/test_examples.py tests/test_docs.py
)
# Left out: type-checking the docs against old stubs (it says nothing about how the code
# runs on them), the etcd and ZooKeeper fault tests (server faults, a minute and more; the
# same client paths run in the conformance suites here), the memory backend of the
# manager conformance suite (no library code) and the 100k-row batches (the paths of
# test_async_batches_past_the_old_limits, at a scale that costs half a minute).
DESELECT=(tests/test_docs.py::test_docs_and_examples_pass_mypy_strict)
SELECT="not (conformance and memory) and not 100k_rows"
