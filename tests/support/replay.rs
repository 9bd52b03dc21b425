//! A clean replay of one partition straight from the events stream: what
//! the NATS tests compare the folders' states with.

use async_nats::jetstream;
use contextfold::core::policy::PolicyConfig;
use contextfold::nats::event_log::NatsEventLog;
use contextfold::nats::setup::Infrastructure;
use contextfold::runtime::embedded;
use contextfold::runtime::engine::Engine;
use contextfold::store::memory_backend::MemoryBackend;

/// Position and state hash of a clean replay of `partition`.
pub async fn replay_partition(
    js: &jetstream::Context,
    infra: &Infrastructure,
    partition: u32,
    policy: &PolicyConfig,
) -> (u64, String) {
    let mut log = NatsEventLog::open_partition(js.clone(), infra.subjects.clone(), partition)
        .await
        .unwrap();
    let mut engine = Engine::open(MemoryBackend::default(), policy.clone()).unwrap();
    embedded::replay(&mut log, &mut engine, None)
        .await
        .expect("replay the partition");
    (engine.position(), engine.state_hash().unwrap())
}
