//! glibc's allocator, set up once at start-up for the proxy's sync thread.
//!
//! glibc keeps small freed blocks in "fastbins" unmerged, and merges all of an arena's at
//! the next request of a large-bin size (`malloc_consolidate`). The proxier runs on the main
//! thread, so whichever sync first asks for a large block after many small frees pays for
//! all of them: 4–8 ms of a 5 ms budget at 10k Services, seen with `perf` on partial syncs
//! from the manifests source (bench/notes/2026-12-04-malloc-fastbins.md). With fastbins off
//! a free merges its own block at once, which costs each free a little and no sync a pause.
//!
//! An operator's own `GLIBC_TUNABLES=glibc.malloc.mxfast=...` wins: it is left alone. On
//! other C libraries (musl, Windows) there is nothing to do.

/// What [`disable_fastbins`] did.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Fastbins {
    /// Turned off now.
    Disabled,
    /// Left as `GLIBC_TUNABLES` set them.
    SetByTunables,
    /// Not glibc: no fastbins to turn off.
    NotGlibc,
}

/// Why fastbins could not be turned off.
#[derive(Debug, thiserror::Error)]
#[error("glibc's mallopt(M_MXFAST, 0) failed")]
pub struct MalloptFailed;

/// Turns glibc's fastbins off for the whole process (every arena), unless `tunables` (the
/// value of `GLIBC_TUNABLES`, if set) already chooses `glibc.malloc.mxfast`. Call it first in
/// `main`, before threads start allocating.
pub fn disable_fastbins(tunables: Option<&str>) -> Result<Fastbins, MalloptFailed> {
    if sets_mxfast(tunables) {
        return Ok(Fastbins::SetByTunables);
    }
    imp::disable()
}

/// Whether a `GLIBC_TUNABLES` value (`name=value:name=value...`) sets `glibc.malloc.mxfast`.
fn sets_mxfast(tunables: Option<&str>) -> bool {
    tunables.is_some_and(|t| {
        t.split(':').any(|pair| {
            pair.split_once('=')
                .is_some_and(|(name, _)| name == "glibc.malloc.mxfast")
        })
    })
}

#[cfg(all(target_os = "linux", target_env = "gnu"))]
mod imp {
    use super::{Fastbins, MalloptFailed};

    pub(super) fn disable() -> Result<Fastbins, MalloptFailed> {
        // SAFETY: mallopt takes no pointers; it changes a global parameter under the
        // arenas' locks (merging the main arena's fastbins first) and returns 1 on success.
        #[allow(unsafe_code)]
        let done = unsafe { libc::mallopt(libc::M_MXFAST, 0) };
        if done == 1 {
            Ok(Fastbins::Disabled)
        } else {
            Err(MalloptFailed)
        }
    }
}

#[cfg(not(all(target_os = "linux", target_env = "gnu")))]
mod imp {
    use super::{Fastbins, MalloptFailed};

    pub(super) fn disable() -> Result<Fastbins, MalloptFailed> {
        Ok(Fastbins::NotGlibc)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_operators_mxfast_tunable_wins() {
        assert!(sets_mxfast(Some("glibc.malloc.mxfast=64")));
        assert!(sets_mxfast(Some(
            "glibc.malloc.arena_max=2:glibc.malloc.mxfast=0"
        )));
        assert!(!sets_mxfast(Some("glibc.malloc.arena_max=2")));
        assert!(!sets_mxfast(Some("glibc.malloc.mxfastx=1")));
        assert!(!sets_mxfast(None));
        assert_eq!(
            disable_fastbins(Some("glibc.malloc.mxfast=64")).ok(),
            Some(Fastbins::SetByTunables)
        );
    }

    /// Bytes in freed fastbin blocks, summed over every arena.
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    fn fastbin_bytes() -> usize {
        // SAFETY: mallinfo2 takes nothing and returns a plain struct.
        #[allow(unsafe_code)]
        let info = unsafe { libc::mallinfo2() };
        info.fsmblks
    }

    /// How much the fastbins grew while 1,000 small blocks (more than the thread cache
    /// holds, as a sync's temporaries) were freed. Measured after allocating them, since a
    /// large allocation (their list's) merges this arena's fastbins first.
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    fn fastbin_growth_from_small_frees() -> i128 {
        let blocks: Vec<Box<[u8; 40]>> = (0..1000u16)
            .map(|i| Box::new([i.to_le_bytes()[0]; 40]))
            .collect();
        std::hint::black_box(&blocks);
        let before = fastbin_bytes();
        drop(blocks);
        fastbin_bytes() as i128 - before as i128
    }

    /// Small frees fill the fastbins before, and add nothing to them after.
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    #[test]
    fn small_frees_no_longer_wait_in_fastbins() {
        let on = fastbin_growth_from_small_frees();
        assert!(
            on >= 900 * 48,
            "glibc kept only {on} bytes of 1,000 freed 48-byte blocks"
        );
        assert_eq!(disable_fastbins(None).ok(), Some(Fastbins::Disabled));
        let off = fastbin_growth_from_small_frees();
        assert!(off <= 0, "the fastbins still grew by {off} bytes");
    }
}
