use std::env;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    println!("cargo::rerun-if-env-changed=DOCS_RS");
    // docs.rs does not need native LLVM setup.
    // https://docs.rs/about/builds#detecting-docsrs
    if env::var_os("DOCS_RS").is_some() {
        return Ok(());
    }

    println!("cargo::rerun-if-env-changed=CUBECL_DEBUG_PLIRON");
    if env::var("CUBECL_DEBUG_PLIRON").is_ok() && env::var("CARGO_FEATURE_STD").is_ok() {
        println!("cargo:rustc-cfg=feature=\"pliron-dump\"");
    }

    #[cfg(any(feature = "amdgpu", feature = "nvptx"))]
    {
        println!("cargo::rerun-if-changed=src/shared/cpp_shims/bitcode.cpp");
        println!("cargo::rerun-if-changed=src/shared/cpp_shims/options.cpp");
        let prefix = tracel_llvm_bundler::config::llvm_path()?.into_os_string();
        let mut shim = cc::Build::new();
        shim.cpp(true)
            .file("src/shared/cpp_shims/bitcode.cpp")
            .file("src/shared/cpp_shims/options.cpp");
        #[cfg(feature = "amdgpu")]
        {
            // kiln patch (see src/amdgpu/lld.rs): no LLD shim, the link runs an external LLD.
            println!("cargo::rerun-if-changed=src/amdgpu/cpp_shims/printf.cpp");
            shim.file("src/amdgpu/cpp_shims/printf.cpp");
        }

        shim.flags(tracel_llvm_bundler::config::get_cxxflags_args(Some(
            &prefix,
        ))?);

        // The LLVM headers have multiple warning under `cc`'s default `-Wall -Wextra`
        shim.warnings(false);
        shim.opt_level(3);
        shim.compile("cubecl_llvm_shim");
    }

    tracel_llvm_bundler::llvm_sys::link()?;

    Ok(())
}
