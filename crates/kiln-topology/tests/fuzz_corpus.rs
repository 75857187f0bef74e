//! The fuzz targets of kiln-topology's parsers (hostfiles and `PBS_NODEFILE`, Slurm
//! hostlists), run over their committed seed corpora and crash regressions
//! (`fuzz/corpus/<target>/`, `fuzz/regressions/<target>/`) as ordinary tests. The harnesses
//! are the fuzz targets' own (`fuzz/harness/`); `scripts/fuzz.sh` runs them under libFuzzer.

#[path = "../../../fuzz/harness/alloc_cap.rs"]
mod alloc_cap;
#[path = "../../../fuzz/harness/corpus.rs"]
mod corpus;
#[path = "../../../fuzz/harness/hostfile.rs"]
mod hostfile;
#[path = "../../../fuzz/harness/hostlist.rs"]
mod hostlist;

#[test]
fn hostfile_seeds_and_regressions() {
    assert!(corpus::run_all("hostfile", hostfile::run) >= 3);
}

#[test]
fn hostlist_seeds_and_regressions() {
    assert!(corpus::run_all("hostlist", hostlist::run) >= 3);
}
