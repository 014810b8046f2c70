//! A copy-on-write view of a database file, so a file that needs recovery can be
//! recovered and checked without writing a byte of it.
//!
//! redb refuses to open a file left by a crash read-only: only a writable open repairs
//! it. To decide whether census may use such a file (schema version, contents) before
//! touching it, the store opens it writable through this backend: reads come from the
//! file, writes stay in memory (only the blocks recovery writes) and vanish on drop.

use std::{
    collections::HashMap,
    fmt,
    fs::File,
    io,
    os::unix::fs::FileExt,
    sync::{Mutex, MutexGuard},
};

use ::redb::StorageBackend;

const BLOCK: u64 = 4096;

pub(super) struct Scratch {
    file: File,
    state: Mutex<State>,
}

struct State {
    /// The length as redb sees it.
    len: u64,
    /// Bytes of the file below this offset are visible where no block overrides them;
    /// past it (after a truncation) everything not written reads as zeros.
    file_visible: u64,
    /// Written blocks, by block number, each `BLOCK` bytes.
    blocks: HashMap<u64, Box<[u8]>>,
}

impl fmt::Debug for Scratch {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Scratch").finish_non_exhaustive()
    }
}

impl Scratch {
    /// Over `file`, which is only ever read.
    pub(super) fn new(file: File) -> io::Result<Self> {
        let len = file.metadata()?.len();
        Ok(Self {
            file,
            state: Mutex::new(State {
                len,
                file_visible: len,
                blocks: HashMap::new(),
            }),
        })
    }

    fn state(&self) -> io::Result<MutexGuard<'_, State>> {
        self.state
            .lock()
            .map_err(|_| io::Error::other("scratch backend lock poisoned"))
    }

    /// Reads `out.len()` bytes at `offset` from the layers below the blocks: the file
    /// where it is visible, zeros elsewhere.
    fn read_base(&self, state: &State, offset: u64, out: &mut [u8]) -> io::Result<()> {
        let from_file = usize::try_from(state.file_visible.saturating_sub(offset))
            .unwrap_or(usize::MAX)
            .min(out.len());
        let (file_part, zero_part) = out.split_at_mut(from_file);
        if !file_part.is_empty() {
            self.file.read_exact_at(file_part, offset)?;
        }
        zero_part.fill(0);
        Ok(())
    }

    fn read_locked(&self, state: &State, offset: u64, out: &mut [u8]) -> io::Result<()> {
        let mut done = 0;
        while done < out.len() {
            let pos = offset + done as u64;
            let block = pos / BLOCK;
            let within = (pos % BLOCK) as usize;
            let n = (BLOCK as usize - within).min(out.len() - done);
            let chunk = &mut out[done..done + n];
            match state.blocks.get(&block) {
                Some(data) => chunk.copy_from_slice(&data[within..within + n]),
                None => self.read_base(state, pos, chunk)?,
            }
            done += n;
        }
        Ok(())
    }
}

fn out_of_range() -> io::Error {
    io::Error::new(
        io::ErrorKind::UnexpectedEof,
        "read past the end of the database",
    )
}

impl StorageBackend for Scratch {
    fn len(&self) -> Result<u64, io::Error> {
        Ok(self.state()?.len)
    }

    fn read(&self, offset: u64, out: &mut [u8]) -> Result<(), io::Error> {
        let state = self.state()?;
        let end = offset
            .checked_add(out.len() as u64)
            .ok_or_else(out_of_range)?;
        if end > state.len {
            return Err(out_of_range());
        }
        self.read_locked(&state, offset, out)
    }

    fn set_len(&self, len: u64) -> Result<(), io::Error> {
        let mut state = self.state()?;
        if len < state.len {
            state.file_visible = state.file_visible.min(len);
            state.blocks.retain(|block, _| block * BLOCK < len);
            // The tail of the last block past the new end must read as zeros if the
            // storage grows again.
            let within = (len % BLOCK) as usize;
            if let Some(data) = state.blocks.get_mut(&(len / BLOCK)) {
                data[within..].fill(0);
            }
        }
        state.len = len;
        Ok(())
    }

    fn sync_data(&self) -> Result<(), io::Error> {
        Ok(())
    }

    fn write(&self, offset: u64, data: &[u8]) -> Result<(), io::Error> {
        let mut state = self.state()?;
        let end = offset
            .checked_add(data.len() as u64)
            .ok_or_else(out_of_range)?;
        // Like a file, a write past the end extends it.
        state.len = state.len.max(end);
        let mut done = 0;
        while done < data.len() {
            let pos = offset + done as u64;
            let block = pos / BLOCK;
            let within = (pos % BLOCK) as usize;
            let n = (BLOCK as usize - within).min(data.len() - done);
            if !state.blocks.contains_key(&block) {
                let mut fresh = vec![0; BLOCK as usize].into_boxed_slice();
                self.read_base(&state, block * BLOCK, &mut fresh)?;
                state.blocks.insert(block, fresh);
            }
            if let Some(target) = state.blocks.get_mut(&block) {
                target[within..within + n].copy_from_slice(&data[done..done + n]);
            }
            done += n;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use std::io::Write as _;

    use super::*;

    fn scratch_over(bytes: &[u8]) -> io::Result<(tempfile::NamedTempFile, Scratch)> {
        let mut file = tempfile::NamedTempFile::new()?;
        file.write_all(bytes)?;
        file.flush()?;
        let scratch = Scratch::new(File::open(file.path())?)?;
        Ok((file, scratch))
    }

    #[test]
    fn writes_shadow_the_file_and_never_reach_it() -> io::Result<()> {
        let original: Vec<u8> = (0..10_000u32).map(|i| (i % 251) as u8).collect();
        let (file, scratch) = scratch_over(&original)?;

        scratch.write(4090, &[0xAA; 20])?;
        let mut out = vec![0; 30];
        scratch.read(4085, &mut out)?;
        assert_eq!(&out[..5], &original[4085..4090]);
        assert_eq!(&out[5..25], &[0xAA; 20]);
        assert_eq!(&out[25..], &original[4110..4115]);

        // Growing reads zeros past the file; writing past the end extends.
        scratch.set_len(20_000)?;
        let mut tail = vec![1; 100];
        scratch.read(19_900, &mut tail)?;
        assert!(tail.iter().all(|b| *b == 0));
        scratch.write(25_000, &[7; 10])?;
        assert_eq!(scratch.len()?, 25_010);

        // Truncating hides the file past the new end, even after growing again.
        scratch.set_len(5_000)?;
        scratch.set_len(9_000)?;
        let mut out = vec![1; 4_000];
        scratch.read(5_000, &mut out)?;
        assert!(out.iter().all(|b| *b == 0));
        let mut head = vec![0; 100];
        scratch.read(4_900, &mut head)?;
        assert_eq!(head, original[4_900..5_000]);

        assert!(
            scratch.read(8_990, &mut [0; 20]).is_err(),
            "reads past the end fail"
        );
        assert_eq!(
            std::fs::read(file.path())?,
            original,
            "the file is never written"
        );
        Ok(())
    }
}
