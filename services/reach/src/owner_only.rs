//! Files and directories only their owner may read: private keys (`reach certs`) and the data
//! directory of `reach dev`. Modes are set when the file or directory is created, never
//! afterwards, so there is no moment when another user could open it.
//!
//! On other platforms than Unix the modes are not set (the files get the platform's defaults).

use std::io::Write as _;
use std::path::Path;

/// The mode of owner-only directories: `rwx------`.
pub const DIR_MODE: u32 = 0o700;
/// The mode of owner-only files: `rw-------`.
pub const FILE_MODE: u32 = 0o600;
/// The mode of files anyone may read (certificates, public keys): `rw-r--r--`.
pub const PUBLIC_FILE_MODE: u32 = 0o644;

/// Creates `dir` and any missing parents with mode 0700 (less the umask). A directory that
/// already exists is left as it is; the result says whether it was created.
///
/// # Errors
/// The I/O error when the directory cannot be created.
pub fn create_dir(dir: &Path) -> std::io::Result<bool> {
    if dir.is_dir() {
        return Ok(false);
    }
    let mut builder = std::fs::DirBuilder::new();
    builder.recursive(true);
    #[cfg(unix)]
    std::os::unix::fs::DirBuilderExt::mode(&mut builder, DIR_MODE);
    builder.create(dir)?;
    Ok(true)
}

/// Whether users other than the owner may read or enter `path` (group or other permission
/// bits set). Always `false` off Unix or when `path` cannot be inspected.
pub fn is_shared(path: &Path) -> bool {
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt as _;
        std::fs::metadata(path).is_ok_and(|m| m.permissions().mode() & 0o077 != 0)
    }
    #[cfg(not(unix))]
    {
        let _ = path;
        false
    }
}

/// Writes `contents` to `path` with `mode` (such as [`FILE_MODE`] or [`PUBLIC_FILE_MODE`]),
/// replacing any file there at once: the bytes go to a new temporary file in the same
/// directory, created with `mode`, which is then renamed over `path`. A process watching
/// `path` (certificate reloading) sees the old file or the new one, never a part.
///
/// # Errors
/// The I/O error when the temporary file cannot be created, written or renamed.
pub fn write(path: &Path, contents: &[u8], mode: u32) -> std::io::Result<()> {
    let dir = path
        .parent()
        .filter(|p| !p.as_os_str().is_empty())
        .unwrap_or(Path::new("."));
    let mut builder = tempfile::Builder::new();
    builder.prefix(".reach-").suffix(".tmp");
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt as _;
        builder.permissions(std::fs::Permissions::from_mode(mode));
    }
    #[cfg(not(unix))]
    let _ = mode;
    let mut file = builder.tempfile_in(dir)?;
    file.write_all(contents)?;
    file.as_file().sync_all()?;
    file.persist(path).map_err(|e| e.error)?;
    Ok(())
}

#[cfg(all(test, unix))]
mod tests {
    use super::*;
    use std::os::unix::fs::PermissionsExt as _;

    fn mode(path: &Path) -> u32 {
        std::fs::metadata(path).unwrap().permissions().mode() & 0o777
    }

    #[test]
    fn directories_and_files_are_created_with_their_modes() {
        let root = tempfile::tempdir().unwrap();
        let dir = root.path().join("a/b");
        assert!(create_dir(&dir).unwrap());
        assert!(!create_dir(&dir).unwrap());
        assert_eq!(mode(&dir), DIR_MODE);
        assert!(!is_shared(&dir));
        let key = dir.join("key.pem");
        write(&key, b"one", FILE_MODE).unwrap();
        assert_eq!(mode(&key), FILE_MODE);
        write(&key, b"two", FILE_MODE).unwrap();
        assert_eq!(std::fs::read(&key).unwrap(), b"two");
        assert_eq!(mode(&key), FILE_MODE);
        let cert = dir.join("cert.pem");
        write(&cert, b"cert", PUBLIC_FILE_MODE).unwrap();
        // The umask may take bits away, never add them.
        assert_eq!(mode(&cert) & !PUBLIC_FILE_MODE, 0);
        assert!(mode(&cert) & 0o600 == 0o600);
        // Nothing but the two files is left behind.
        assert_eq!(std::fs::read_dir(&dir).unwrap().count(), 2);
    }
}
