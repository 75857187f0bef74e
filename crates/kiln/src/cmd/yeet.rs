//! `kiln yeet`: flags in, [`kiln_data::yeet`] out.

use std::io::IsTerminal;
use std::path::PathBuf;
use std::process::ExitCode;

/// Arguments of `kiln yeet`.
#[derive(Debug, clap::Args)]
#[command(after_long_help = "\
Run it on every node of the allocation with an MPI launcher, one rank per node:
  kiln launch --mpi --ppn 1 -- kiln yeet /lus/proj/env.tar.gz --dest /tmp
  srun --ntasks-per-node=1 kiln yeet /lus/proj/venv --dest /local/scratch
Rank 0 alone reads SRC from the shared file system and broadcasts it in 4 MiB chunks over
MPI (a tree: log2(nodes) rounds per chunk, chunks pipelined). On each node one rank writes
it as it arrives (a temporary file, or an archive unpacked into a temporary directory),
checks the stream's SHA-256 against rank 0's, and only then publishes it atomically. A node
that cannot write stays in the broadcasts and is named at the end; the others get their copy:

  SRC is a directory            -> DEST/<dirname>/   (sent as a tar stream)
  SRC is NAME.tar[.gz] or .tgz  -> DEST/NAME/        (unpacked)
  SRC is any other file         -> DEST/<filename>

An archive member that would land outside DEST (absolute path, `..`, a link pointing out,
a device file) is refused and nothing is published. `{rank}` in DEST makes every rank write
its own copy (DEST differs per rank; for trying it on one machine).

Exit codes: 0 every node has the copy; 1 a node failed (named), or the source is unreadable;
78 refused (unsafe archive, destination exists without --force).")]
pub struct YeetArgs {
    /// File, directory or tarball to distribute (read by rank 0 only).
    pub src: PathBuf,
    /// Directory on every node that receives it (`{rank}` expands to the rank).
    #[arg(long, default_value = "/tmp")]
    pub dest: String,
    /// Replace an existing copy at the destination.
    #[arg(long)]
    pub force: bool,
}

/// `kiln yeet`.
pub fn run(args: YeetArgs) -> anyhow::Result<ExitCode> {
    let env = kiln_topology::RankEnv::from_process_env()?;
    let comm = kiln_dist::init(&env, false)?;
    let rank0 = comm.rank() == 0;
    let bar = (rank0 && std::io::stderr().is_terminal()).then(|| {
        let bar = indicatif::ProgressBar::new_spinner();
        bar.set_style(
            indicatif::ProgressStyle::with_template("{spinner} {bytes} sent ({bytes_per_sec})")
                .unwrap_or_else(|_| indicatif::ProgressStyle::default_spinner()),
        );
        bar
    });
    let opts = kiln_data::yeet::YeetOptions {
        source: args.src,
        dest: args.dest,
        force: args.force,
    };
    let result = kiln_data::yeet::yeet(comm.as_ref(), &opts, |sent| {
        if let Some(bar) = &bar {
            bar.set_position(sent);
        }
    });
    if let Some(bar) = &bar {
        bar.finish_and_clear();
    }
    match result {
        Ok(r) => {
            if rank0 {
                println!(
                    "yeet: {} bytes to {} node(s) in {:.2}s ({:.1} MB/s), sha256 {} -> {}",
                    r.bytes,
                    r.writers,
                    r.seconds,
                    r.bytes as f64 / r.seconds.max(1e-9) / 1e6,
                    r.sha256,
                    r.path.display()
                );
            }
            Ok(ExitCode::SUCCESS)
        }
        Err(e) => Err(anyhow::Error::new(e).context("yeet")),
    }
}
