// Included (`include!`) by nats_server.rs and llm_server.rs, which some
// test binaries load on their own with `#[path]`.

/// Where test servers listen: below the kernel's ephemeral range
/// (`ip_local_port_range`, 32768-60999 by default). A port the kernel hands
/// out for port 0 is one it also hands to outgoing connections, so between
/// picking it and the server binding it any client socket on the machine
/// could take it (CI failed that way on a cluster route port).
const TEST_PORTS: std::ops::Range<u16> = 20_000..32_000;

/// A loopback port nobody listens on right now, outside the ephemeral range,
/// never the same twice in one test process.
pub fn free_port() -> u16 {
    use std::collections::HashSet;
    use std::hash::{BuildHasher, Hasher};
    use std::sync::Mutex;
    static HANDED_OUT: Mutex<Option<HashSet<u16>>> = Mutex::new(None);
    let span = u64::from(TEST_PORTS.end - TEST_PORTS.start);
    for _ in 0..1_000 {
        // RandomState is seeded per instance: a different start per call and per process.
        let mut h = std::collections::hash_map::RandomState::new().build_hasher();
        h.write_u32(std::process::id());
        let port = TEST_PORTS.start + (h.finish() % span) as u16;
        let mut handed = HANDED_OUT.lock().unwrap_or_else(|p| p.into_inner());
        let handed = handed.get_or_insert_with(HashSet::new);
        if handed.contains(&port) || std::net::TcpListener::bind(("127.0.0.1", port)).is_err() {
            continue;
        }
        handed.insert(port);
        return port;
    }
    panic!("no free loopback port in {TEST_PORTS:?} after 1000 tries");
}
