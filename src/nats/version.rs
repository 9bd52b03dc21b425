//! The server version check made at connect.
//!
//! contextfold relies on stream subject transforms (partitioning) and
//! multi-filter consumers, both from nats-server 2.10. An older server
//! (Debian ships 2.9.10) accepts those stream settings and silently ignores
//! them, which would put every conversation in one unpartitioned subject
//! space: so an old server is refused up front, not discovered later.

use crate::nats::NatsError;
use std::fmt;
use std::str::FromStr;

/// A server release: `major.minor.patch` (pre-release suffixes ignored).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct ServerVersion {
    pub major: u64,
    pub minor: u64,
    pub patch: u64,
}

/// The oldest server contextfold runs against.
pub const MIN_SERVER_VERSION: ServerVersion = ServerVersion {
    major: 2,
    minor: 10,
    patch: 0,
};

impl ServerVersion {
    pub const fn new(major: u64, minor: u64, patch: u64) -> Self {
        ServerVersion {
            major,
            minor,
            patch,
        }
    }
}

impl FromStr for ServerVersion {
    type Err = String;

    /// Parses `2.15.1`, `v2.10.0-RC.3`, `2.11.0+build` (suffix dropped: a
    /// release candidate already has the features of its release).
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let trimmed = s.trim();
        let core = trimmed.strip_prefix('v').unwrap_or(trimmed);
        let core = core.split(['-', '+']).next().unwrap_or_default();
        let mut parts = core.split('.');
        let mut next = |name: &str, required: bool| -> Result<u64, String> {
            match parts.next() {
                Some(p) => p
                    .parse::<u64>()
                    .map_err(|_| format!("bad {name} number in server version {s:?}")),
                None if required => Err(format!("server version {s:?} has no {name} number")),
                None => Ok(0),
            }
        };
        let major = next("major", true)?;
        let minor = next("minor", true)?;
        let patch = next("patch", false)?;
        Ok(ServerVersion::new(major, minor, patch))
    }
}

impl fmt::Display for ServerVersion {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}.{}.{}", self.major, self.minor, self.patch)
    }
}

/// Accepts `reported` when it is at least `minimum`.
pub fn check_server_version(
    reported: &str,
    minimum: ServerVersion,
) -> Result<ServerVersion, NatsError> {
    let version: ServerVersion =
        reported
            .parse()
            .map_err(|detail: String| NatsError::ServerVersion {
                found: reported.to_string(),
                minimum,
                detail,
            })?;
    if version < minimum {
        return Err(NatsError::ServerVersion {
            found: reported.to_string(),
            minimum,
            detail: "it ignores stream subject transforms and multi-filter consumers that \
                     contextfold needs; install a current server with scripts/install-nats.sh"
                .to_string(),
        });
    }
    Ok(version)
}

/// Checks what a connected client learned from the server's INFO: version
/// and JetStream.
pub fn check_server(client: &async_nats::Client) -> Result<ServerVersion, NatsError> {
    let info = client.server_info();
    let version = check_server_version(&info.version, MIN_SERVER_VERSION)?;
    if !info.jetstream {
        return Err(NatsError::JetStreamDisabled {
            server: if info.server_name.is_empty() {
                info.server_id
            } else {
                info.server_name
            },
        });
    }
    Ok(version)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_release_and_prerelease_forms() {
        assert_eq!(
            "2.15.1".parse::<ServerVersion>().unwrap(),
            ServerVersion::new(2, 15, 1)
        );
        assert_eq!(
            "v2.10.0-RC.3".parse::<ServerVersion>().unwrap(),
            ServerVersion::new(2, 10, 0)
        );
        assert_eq!(
            "2.11".parse::<ServerVersion>().unwrap(),
            ServerVersion::new(2, 11, 0)
        );
        for bad in ["", "two.ten", "2", "2.x.1"] {
            assert!(bad.parse::<ServerVersion>().is_err(), "{bad:?}");
        }
    }

    #[test]
    fn orders_numerically_not_lexically() {
        assert!(ServerVersion::new(2, 9, 10) < ServerVersion::new(2, 10, 0));
        assert!(ServerVersion::new(2, 10, 0) < ServerVersion::new(2, 10, 1));
        assert!(ServerVersion::new(10, 0, 0) > ServerVersion::new(2, 99, 99));
    }

    #[test]
    fn refuses_debian_2_9_10_with_a_clear_message() {
        let err = check_server_version("2.9.10", MIN_SERVER_VERSION).unwrap_err();
        let msg = err.to_string();
        assert!(msg.contains("2.9.10"), "{msg}");
        assert!(msg.contains("2.10.0"), "{msg}");
        assert!(msg.contains("install-nats.sh"), "{msg}");
    }

    #[test]
    fn accepts_the_minimum_and_newer() {
        for ok in ["2.10.0", "2.10.0-beta.1", "2.15.1", "3.0.0"] {
            assert!(check_server_version(ok, MIN_SERVER_VERSION).is_ok(), "{ok}");
        }
        assert!(check_server_version("garbage", MIN_SERVER_VERSION).is_err());
    }
}
